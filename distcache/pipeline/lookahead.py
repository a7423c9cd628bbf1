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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distcache.errors import DistcacheConfigError, LookaheadWindowError
from distcache.sharding.sharded_module import ShardedCachedEmbeddingBagCollection


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

    @property
    def lookahead(self) -> int:
        return self._lookahead

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train the oldest batch in the window; returns the model's output for it.

        Raises:
            StopIteration: the data and the window are drained (every batch was trained).
        """
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
        return output

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
