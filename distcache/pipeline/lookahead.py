"""`LookaheadTrainPipeline`: keeps L batches routed ahead of the one training (CPU, in order).

Each batch is routed once, when it enters the window: TorchRec's input distribution sends its
ids to the ranks that own their rows, and the routed ids enter the caches' look-ahead windows
through TorchRec's `prefetch` hook. Rows are staged K batches ahead. When the batch trains, its
sharded modules reuse the routed input instead of routing it again.

Stages, in the order `progress` runs them, with the batch each works on (t = training batch):

    fill      t + L   read, copy to the device, input all-to-all, enqueue in the caches' windows
    forward   t       lookups from the cache (rows staged, no critical-path miss)
    stage     t + K   stage the next rows while batch t trains
    backward  t       fused row update in the caches; dense optimizer step

This first version runs the stages in order on the calling thread (CPU, and CUDA without side
streams); it drives the distcache-sharded modules of a `DistributedModelParallel` model whose
forward takes the batch and returns `(loss, output)`, like TorchRec's `DLRMTrain`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distcache.errors import DistcacheConfigError, LookaheadWindowError
from distcache.sharding.sharded_module import ShardedCachedEmbeddingBagCollection

log = logging.getLogger(__name__)
_SUMMED = (
    "batches",
    "ids",
    "unique",
    "hits",
    "loads",
    "writebacks",
    "evictions",
    "critical_misses",
    "bytes_loaded",
    "bytes_written",
    "capacity",
    "num_rows",
)


@dataclass
class _InFlight:
    batch: Any
    sparse: Any  # the KeyedJaggedTensor the sharded module was routed from
    ctx: Any  # the sharded module's context for this batch
    routed: Any  # its input-dist output (per sharding, this rank's shard-local ids)


class LookaheadTrainPipeline:
    """TorchRec's train-pipeline contract with a look-ahead window.

    Args:
        model: a `DistributedModelParallel` (or any module) holding exactly one
            distcache-sharded `EmbeddingBagCollection`; `model(batch)` returns `(loss, output)`.
        optimizer: the dense optimizer (embedding rows are updated in backward), or None.
        device: where batches are copied.
        lookahead: L, batches routed ahead of the training one (default: the caches' lookahead;
            at most that).
        sparse_input: how to get the sharded module's `KeyedJaggedTensor` from a batch
            (default: `batch.sparse_features`, TorchRec's `Batch`).
        log_every: log `stats()` through `logging` every this many trained batches (0: never).

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
        device: torch.device,
        *,
        lookahead: int | None = None,
        sparse_input: Callable[[Any], Any] | None = None,
        log_every: int = 0,
    ):
        modules = [m for m in model.modules() if isinstance(m, ShardedCachedEmbeddingBagCollection)]
        if len(modules) != 1:
            raise DistcacheConfigError(
                f"LookaheadTrainPipeline drives exactly one distcache-sharded "
                f"EmbeddingBagCollection; the model has {len(modules)}"
            )
        self._module = modules[0]
        windows = [k.cache_config.lookahead for k in self._module.cached_kernels()]
        most = min(windows) if windows else 0
        lookahead = most if lookahead is None else lookahead
        if not 0 <= lookahead <= most:
            raise DistcacheConfigError(
                f"lookahead={lookahead} is invalid: expected 0 <= lookahead <= {most}, the "
                "smallest lookahead of the caches' CacheConfig"
            )
        self._model = model
        self._optimizer = optimizer
        self._device = device
        self._lookahead = lookahead
        self._sparse_input = sparse_input or (lambda batch: batch.sparse_features)
        self._window: deque[_InFlight] = deque()
        self._exhausted = False
        self._log_every = log_every
        self._trained = 0
        self._step_s = 0.0

    @property
    def lookahead(self) -> int:
        return self._lookahead

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train the oldest batch in the window; returns the model's output for it.

        Raises:
            StopIteration: the data and the window are drained (every batch was trained).
        """
        start = time.perf_counter()
        self._fill(dataloader_iter)
        if not self._window:
            raise StopIteration
        current = self._window[0]
        self._model.train()
        with self._routed_forward(current):
            loss, output = self._model(current.batch)
        self._module.stage_ahead()  # the next rows move while this batch trains
        if self._optimizer is not None:
            self._optimizer.zero_grad()
        loss.backward()
        if self._optimizer is not None:
            self._optimizer.step()
        self._window.popleft()
        self._trained += 1
        self._step_s += time.perf_counter() - start
        if self._log_every and self._trained % self._log_every == 0:
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
        return output

    def stats(self) -> dict[str, dict[str, float]]:
        """This rank's cache counters per cache (tables of one width share one) and in total,
        with the fraction of the pipeline's step time that lookups waited on staging."""
        per_cache = {name: s.as_dict() for name, s in self._module.cache_stats().items()}
        total: dict[str, float] = {k: sum(s[k] for s in per_cache.values()) for k in _SUMMED}
        total["staging_s"] = sum(s["staging_s"] for s in per_cache.values())
        total["wait_s"] = sum(s["wait_s"] for s in per_cache.values())
        total["hit_rate"] = total["hits"] / total["unique"] if total["unique"] else 0.0
        total["trained_batches"] = self._trained
        total["step_s"] = self._step_s
        total["wait_fraction"] = total["wait_s"] / self._step_s if self._step_s else 0.0
        return {**per_cache, "total": total}

    def _fill(self, dataloader_iter: Iterator[Any]) -> None:
        while not self._exhausted and len(self._window) <= self._lookahead:
            batch = next(dataloader_iter, None)
            if batch is None:
                self._exhausted = True
                break
            batch = batch.to(self._device) if hasattr(batch, "to") else batch
            sparse = self._sparse_input(batch)
            ctx = self._module.create_context()
            routed = self._module.input_dist(ctx, sparse).wait().wait()
            self._module.prefetch(dist_input=routed, forward_stream=None, ctx=ctx)
            self._window.append(_InFlight(batch, sparse, ctx, routed))

    @contextlib.contextmanager
    def _routed_forward(self, current: _InFlight) -> Iterator[None]:
        """While the batch trains, the sharded module reuses its routed input."""
        module = self._module

        def forward(features: Any, *args: Any, **kwargs: Any) -> Any:
            if features is not current.sparse and (
                list(features.keys()) != list(current.sparse.keys())
                or features.values().numel() != current.sparse.values().numel()
            ):
                raise LookaheadWindowError(
                    "the sharded module was called with features other than the batch's "
                    "sparse input (sparse_input): the pipeline routed a different batch"
                )
            return module.compute_and_output_dist(current.ctx, current.routed)

        module.forward = forward
        try:
            yield
        finally:
            del module.forward
