"""`LookaheadTrainPipeline`: keeps L batches routed ahead of the one training.

Each batch is routed once, when it enters the window: TorchRec's input distribution sends its
ids to the ranks that own their rows, and the routed ids enter the caches' look-ahead windows
through TorchRec's `prefetch` hook. Rows are staged K batches ahead. When the batch trains, its
sharded modules reuse the routed input instead of routing it again: the pipeline hands it to
them for the batch's forward (`CachedShardedModule.routed`), and replaces nothing of the model,
so outside `progress` (an evaluation) the modules route their input as usual.

Stages, in the order `progress` runs them, with the batch each works on (t = training batch)
and the stream it uses on CUDA (on CPU everything runs in order on the calling thread):

    copy      t+L+1   read from the loader, copy to the device         copy stream
    route     t+L+1   input all-to-all started before t's forward, advanced after it, and
                      finished after t's backward; its ids then enter the caches' windows
                      (the exchange overlaps t's compute)               default stream
    forward   t       lookups from the cache (rows staged, no critical-path miss)  default
    stage     t + K   write back victims, load the next rows while t trains  the caches' own
                      staging stream, fenced by events (`distcache.cache.stager`)
    backward  t       fused row update in the caches; dense optimizer step  default stream

The pipeline drives every distcache-sharded `EmbeddingBagCollection` and `EmbeddingCollection`
of a `DistributedModelParallel` model whose forward takes the batch and returns `(loss, output)`,
like TorchRec's `DLRMTrain`; modules TorchRec's own sharders shard run as usual inside forward.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import nn

from distcache.cache.counters import sum_stats
from distcache.cache.streams import stream_on
from distcache.errors import DistcacheConfigError, LookaheadWindowError
from distcache.sharding.sharded_module import CachedShardedModule, RoutedInput, user_path

if TYPE_CHECKING:
    from torchrec.distributed.embedding_types import KJTList
    from torchrec.distributed.types import Awaitable
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torchrec.streamable import Multistreamable

log = logging.getLogger(__name__)

In = TypeVar("In")  # a batch, as the loader yields it (e.g. TorchRec's `Batch`)
Out = TypeVar("Out")  # the model's output for a batch, beside its loss


@dataclass
class _Routing:
    """One sharded module's part of a batch entering the window, while its input all-to-all
    runs in two exchanges: the splits' (started with the input dist), then the ids'
    (`advance`, once the splits arrived); `finish` waits for the ids."""

    path: str  # the module's path in the user's model
    features: KeyedJaggedTensor  # the module's sparse input
    ctx: Multistreamable  # the module's context for the batch
    splits: Awaitable[Awaitable[KJTList]]  # the input dist, started: the splits' exchange
    ids: Awaitable[KJTList] | None = None  # the ids' exchange, once `advance` started it

    def advance(self) -> Awaitable[KJTList]:
        """Wait for the splits and start the ids' exchange (once)."""
        if self.ids is None:
            self.ids = self.splits.wait()
        return self.ids

    def finish(self) -> RoutedInput:
        """Wait for the ids: the module's input for the batch, routed."""
        return RoutedInput(self.features, self.ctx, self.advance().wait(), self.path)


@dataclass
class _Incoming(Generic[In]):
    """A batch entering the window: copied, its input all-to-all running."""

    batch: In
    routing: list[_Routing]  # one per sharded module


@dataclass
class _InFlight(Generic[In]):
    """A batch in the window: routed, its ids in the caches' look-ahead windows."""

    batch: In
    routed: dict[str, RoutedInput]  # module path -> the module's routed input


def _sparse_features(batch: object) -> KeyedJaggedTensor:
    """The default `sparse_input`: TorchRec's `Batch.sparse_features`."""
    try:
        return batch.sparse_features  # type: ignore[attr-defined]
    except AttributeError:
        raise DistcacheConfigError(
            f"a batch of type {type(batch).__name__} has no sparse_features; give batches "
            "like TorchRec's Batch, or LookaheadTrainPipeline(..., sparse_input=lambda batch: "
            "its KeyedJaggedTensor)"
        ) from None


class LookaheadTrainPipeline(Generic[In, Out]):
    """TorchRec's train-pipeline contract with a look-ahead window.

    Args:
        model: a `DistributedModelParallel` (or any module) holding one or more
            distcache-sharded `EmbeddingBagCollection`s or `EmbeddingCollection`s;
            `model(batch)` returns
            `(loss, output)`.
        optimizer: the dense optimizer (embedding rows are updated in backward), or None.
        device: where batches are copied.
        lookahead: L, batches routed ahead of the training one (default: the caches'
            lookahead; at most that).
        prefetch_depth: K <= L, batches whose rows are staged ahead of the training one
            (default: the caches' prefetch depth, at most L).
        sparse_input: how to get a sharded module's `KeyedJaggedTensor` from a batch. Default,
            with one distcache-sharded module: `batch.sparse_features` (TorchRec's `Batch`).
            With several, required: `batch -> {module path: KeyedJaggedTensor}`, the paths in
            the model DMP wrapped (without DMP's and DDP's wrapper prefixes).
        log_every: log `stats()` through `logging` every this many trained batches (0: never).
        skip_nonfinite: a batch whose loss is NaN or infinite on any rank gets no backward
            and no optimizer step on any rank (its rows are released unchanged) and is counted
            in `stats()["total"]["skipped_nonfinite"]`. Costs one all-reduce of a flag and one
            device read per batch, so it is off by default.

    An exception in any stage propagates from `progress`; the pipeline then drops its window
    (those batches were read but not trained) and is closed: a later `progress` raises. Every
    update made so far is kept, so a new pipeline on the same model goes on from the batch after
    the last one trained (see `close`); nothing needs to be reloaded.

    Example::

        pipeline = LookaheadTrainPipeline(dmp_model, dense_optimizer, torch.device("cpu"))
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)
            except StopIteration:
                break
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device | str,
        *,
        lookahead: int | None = None,
        prefetch_depth: int | None = None,
        sparse_input: Callable[[In], KeyedJaggedTensor | Mapping[str, KeyedJaggedTensor]]
        | None = None,
        log_every: int = 0,
        skip_nonfinite: bool = False,
    ):
        self._modules = {
            user_path(path): m
            for path, m in model.named_modules()
            if isinstance(m, CachedShardedModule)
        }
        if not self._modules:
            raise DistcacheConfigError(
                "LookaheadTrainPipeline found no distcache-sharded EmbeddingBagCollection or "
                "EmbeddingCollection in the model: shard it with DistributedModelParallel and "
                "CachedEmbeddingBagCollectionSharder or CachedEmbeddingCollectionSharder"
            )
        if sparse_input is None and len(self._modules) > 1:
            raise DistcacheConfigError(
                f"the model has {len(self._modules)} distcache-sharded modules "
                f"{sorted(self._modules)}: pass sparse_input=lambda batch: "
                "{module path: KeyedJaggedTensor}"
            )
        self._bags = [k.bags for m in self._modules.values() for k in m.cached_kernels()]
        # Reactive caches (lru, lfu) use no future knowledge: they do not bound the window.
        # Every rank's caches bound it (the plan's configs), not only this rank's: the ranks
        # route the same batches ahead, collective for collective, even where one holds no cache.
        planned = [c for m in self._modules.values() for c in m.planned_cache_configs()]
        ahead = [c for c in planned or [b.config for b in self._bags] if not c.is_reactive]
        self._lookahead = _window_setting(
            "lookahead", lookahead, min((c.lookahead for c in ahead), default=0)
        )
        self._depth = _window_setting(
            "prefetch_depth",
            prefetch_depth,
            min(min((c.prefetch_depth for c in ahead), default=0), self._lookahead),
            most=self._lookahead,
        )
        for bags in self._bags:
            bags.prefetch_depth = self._depth
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._sparse_input = sparse_input or _sparse_features
        self._copy_stream = (
            torch.cuda.Stream(device=self._device) if self._device.type == "cuda" else None
        )
        self._index = None if self._copy_stream is None else self._copy_stream.device_index
        self._window: deque[_InFlight[In]] = deque()
        left = sum(bags.num_enqueued for bags in self._bags)
        if left:  # an earlier pipeline was left with batches in its window (not trained)
            log.info("dropping %d batch(es) an earlier pipeline left enqueued, untrained", left)
            self._drop_window()
        self._exhausted = False
        self._failed: BaseException | None = None
        self._log_every = log_every
        self._skip_nonfinite = skip_nonfinite
        self._skipped_nonfinite = 0
        self._trained = 0
        self._step_s = 0.0

    @property
    def lookahead(self) -> int:
        return self._lookahead

    @property
    def prefetch_depth(self) -> int:
        return self._depth

    @property
    def skipped_nonfinite(self) -> int:
        """Batches skipped for a non-finite loss so far (with `skip_nonfinite`)."""
        return self._skipped_nonfinite

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Train the oldest batch in the window; returns the model's output for it.

        Raises:
            StopIteration: the data and the window are drained (every batch was trained).
                The pipeline can then go on with a new iterator, e.g. after an evaluation or a
                checkpoint taken with the window empty.
        """
        if self._failed is not None:
            raise LookaheadWindowError(
                "the pipeline is closed: a previous progress() raised "
                f"{type(self._failed).__name__}: {self._failed}"
            )
        start = time.perf_counter()
        if not self._model.training:  # (before routing: batches enqueued in training are
            self._model.train()  # looked up only by training; `CachedEmbeddingBags.forward`)
        try:
            self._fill(dataloader_iter)
            if not self._window:
                self._exhausted = False  # drained: the next progress() may bring new data
                raise StopIteration
            incoming = self._start_next(dataloader_iter)  # batch t + L + 1, routed meanwhile
            output = self._train(self._window[0], incoming)
            if incoming is not None:
                self._window.append(self._finish_route(incoming))
        except StopIteration:
            raise
        except BaseException as err:
            self._failed = err
            self._drop_window()
            raise
        self._window.popleft()
        self._trained += 1
        self._step_s += time.perf_counter() - start
        if self._log_every and self._trained % self._log_every == 0:
            self._log()
        return output

    def close(self) -> None:
        """Drop the batches in the window (read from the loader, not trained) and close the
        pipeline. Cached rows and every update made so far are kept: a new pipeline on the same
        model goes on training, from the batch after the last one trained. `progress` does the
        same when it raises, so after an error a new pipeline is all it takes."""
        self._failed = self._failed or LookaheadWindowError("close() was called")
        self._drop_window()

    def _drop_window(self) -> None:
        for bags in self._bags:
            bags.drop_window()
        self._window.clear()

    def stats(self) -> dict[str, dict[str, float]]:
        """This rank's cache counters per cache (`module path/tables`; tables of one width
        share a cache) and in total, with the fraction of the pipeline's step time that lookups
        waited on staging."""
        stats = {
            f"{path}/{name}" if path else name: s
            for path, module in self._modules.items()
            for name, s in module.cache_stats().items()
        }
        total = sum_stats(stats.values())
        total["trained_batches"] = self._trained
        total["skipped_nonfinite"] = self._skipped_nonfinite
        total["step_s"] = self._step_s
        total["wait_fraction"] = total["wait_s"] / self._step_s if self._step_s else 0.0
        return {**{name: s.as_dict() for name, s in stats.items()}, "total": total}

    # ------------------------------------------------------------ stages
    def _fill(self, dataloader_iter: Iterator[In]) -> None:
        """copy + route, batch t + L: keep L batches routed beyond the training one (at the
        start, and after the window drained; in steady state `_start_next` keeps it full)."""
        while not self._exhausted and len(self._window) <= self._lookahead:
            batch = self._next(dataloader_iter)
            if batch is None:
                break
            self._window.append(self._finish_route(self._start_route(batch)))

    def _next(self, dataloader_iter: Iterator[In]) -> In | None:
        batch = next(dataloader_iter, None)
        if batch is None:
            self._exhausted = True
            return None
        return self._copy(batch)

    def _start_next(self, dataloader_iter: Iterator[In]) -> _Incoming[In] | None:
        """The batch entering the window once batch t trains: read, copied and its input
        all-to-all started now, so the exchange overlaps batch t's forward and backward."""
        if self._exhausted or len(self._window) <= self._lookahead:
            return None
        batch = self._next(dataloader_iter)
        return None if batch is None else self._start_route(batch)

    def _copy(self, batch: In) -> In:
        """copy, batch t + L: to the device; on CUDA on the copy stream, fenced before use."""
        if not hasattr(batch, "to"):
            return batch
        if self._copy_stream is None:
            return batch.to(self._device)
        with stream_on(self._copy_stream, self._index):
            batch = batch.to(self._device, non_blocking=True)
        current = torch.cuda.current_stream(self._index)  # (by index: `Streams`)
        current.wait_stream(self._copy_stream)
        if hasattr(batch, "record_stream"):  # its memory is used on the default stream
            batch.record_stream(current)
        return batch

    def _start_route(self, batch: In) -> _Incoming[In]:
        """route (start), batch t + L + 1: start every sharded module's input all-to-all."""
        sparse = self._sparse_input(batch)
        if len(self._modules) == 1 and not isinstance(sparse, dict):
            sparse = {next(iter(self._modules)): sparse}
        missing = sorted(set(self._modules) - set(sparse))
        if missing:
            raise DistcacheConfigError(
                f"sparse_input returned no features for modules {missing}; expected keys "
                f"{sorted(self._modules)}"
            )
        for path, features in sparse.items():
            if not hasattr(features, "keys") or not hasattr(features, "lengths"):
                raise DistcacheConfigError(
                    f"the sparse input of {path!r} is a {type(features).__name__}; expected a "
                    "KeyedJaggedTensor (from sparse_input, or the batch's sparse_features)"
                )
        routing = []
        with torch.profiler.record_function("## distcache:route ##"):
            for path, module in self._modules.items():
                ctx = module.create_context()
                splits = module.input_dist(ctx, sparse[path])
                routing.append(_Routing(path, sparse[path], ctx, splits))
        return _Incoming(batch, routing)

    def _advance_route(self, incoming: _Incoming[In] | None) -> None:
        """route (splits received), batch t + L + 1: start the ids' exchange."""
        if incoming is None:
            return
        for routing in incoming.routing:
            routing.advance()

    def _finish_route(self, incoming: _Incoming[In]) -> _InFlight[In]:
        """route (finish), batch t + L + 1: the routed ids enter the caches' look-ahead windows
        (TorchRec's prefetch hook), staged up to K ahead."""
        routed = {}
        with torch.profiler.record_function("## distcache:route ##"):
            for routing in incoming.routing:
                part = routing.finish()  # the module's part of the batch, routed
                module = self._modules[part.path]
                module.prefetch(dist_input=part.dist_input, forward_stream=None, ctx=part.ctx)
                routed[part.path] = part
        return _InFlight(incoming.batch, routed)

    def _train(self, current: _InFlight[In], incoming: _Incoming[In] | None) -> Out:
        """forward (t), stage (t + K), backward and optimizer (t); the incoming batch's
        exchange advances between them."""
        with (
            self._routed_forward(current),
            torch.profiler.record_function("## distcache:forward ##"),
        ):
            loss, output = self._model(current.batch)
        with torch.profiler.record_function("## distcache:stage ##"):
            for module in self._modules.values():
                module.stage_ahead()  # the next rows move while this batch trains
        self._advance_route(incoming)
        if self._skip_nonfinite and not _finite_everywhere(loss):
            self._skipped_nonfinite += 1
            for bags in self._bags:  # its rows: released unchanged, not dirty
                for engine in bags.engines:
                    engine.release_stale()
            return output
        with torch.profiler.record_function("## distcache:backward ##"):
            if self._optimizer is not None:
                self._optimizer.zero_grad()
            loss.backward()
            if self._optimizer is not None:
                self._optimizer.step()
        return output

    @contextlib.contextmanager
    def _routed_forward(self, current: _InFlight[In]) -> Iterator[None]:
        """While the batch trains, each sharded module computes it from its routed input."""
        with contextlib.ExitStack() as stack:
            for path, module in self._modules.items():
                stack.enter_context(module.routed(current.routed[path]))
            yield

    def _log(self) -> None:
        total = self.stats()["total"]
        log.info(
            "batch %d: hit rate %.3f, loads %d, write-backs %d, critical misses %d, "
            "staged %.1f MB, waited on staging %.1f %% of step time",
            self._trained,
            total["hit_rate"],
            total["loads"],
            total["writebacks"],
            total["critical_misses"],
            total["bytes_loaded"] / 1e6,
            100 * total["wait_fraction"],
        )


def _finite_everywhere(loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every rank (a device read: only with skip_nonfinite)."""
    flag = torch.isfinite(loss.detach()).all().to(torch.int32)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag)


def _window_setting(name: str, value: int | None, default: int, most: int | None = None) -> int:
    most = default if most is None else most
    value = default if value is None else value
    if not 0 <= value <= most:
        raise DistcacheConfigError(
            f"{name}={value} is invalid: expected 0 <= {name} <= {most}"
            + (
                ", the smallest lookahead of the caches' CacheConfig"
                if name == "lookahead"
                else ", the pipeline's lookahead"
            )
        )
    return value
