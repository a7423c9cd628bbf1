"""`TbeKernel`: FBGEMM's table-batched embedding (TBE) looking rows up and updating them in one
cache's slots (`CacheConfig.kernel='fbgemm'`).

TorchRec's `fused` kernel is FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen`: one forward
kernel pools every bag of a batch, one backward kernel sums each row's gradient and applies the
optimizer to the row. Here it runs over a cache instead of a table: one TBE table whose rows are
the cache's `capacity + 2` slots (the sentinel and trash slots last), the ids it looks up the
batch's slots (`StagePlan.id_slots`), its bags the group's bags (`t * B` of them, feature-major,
as one TBE feature: every feature of the group maps to the one table). The cache *is* the TBE's
storage: `weights` and `state` view its weight and optimizer-state tensors, so the stager moves
rows and their state in and out of it as it does for the torch kernel.

FBGEMM computes distcache's optimizers (`distcache.cache.optimizers`) as they are defined, each
row's gradient summed over the batch first (its `EXACT_` optimizers; weight decay 0; the torch
kernel's fp32 SGD adds each id's step instead, as torch's sparse SGD does):
- `EXACT_SGD`: w -= lr * g;
- `EXACT_ADAGRAD`: s += g * g, w -= lr * g / (sqrt(s) + eps), element-wise;
- `EXACT_ROWWISE_ADAGRAD`: s += mean of g * g over the row, w -= lr / (sqrt(s) + eps) * g;
its state is laid out as distcache's: one float per row (row-wise Adagrad), one per element
(Adagrad). Adam is not: FBGEMM keeps the two moments in two tensors (distcache keeps them with
the row) and bias-corrects with its own step count; it stays on the torch kernel. The floats
round differently (`lr * g / d` against `lr * (g / d)`): equal within float tolerance, bitwise
where the arithmetic is exact. fp16 rows are updated in fp32 and rounded as
`CacheConfig.stochastic_rounding` says, by FBGEMM (on CUDA stochastically by default; its CPU
kernels round to nearest: asked for stochastic rounding on CPU, the torch kernel serves). bf16
rows stay on the torch kernel: FBGEMM's CPU kernels have none, and its CUDA TBE refuses them
("cache_precision bf16 not supported").

Padding: FBGEMM's CUDA backward sorts every id it was given, but only the ids inside a bag get a
sort key (`transpose_embedding_input`): an id past the last bag would update an undefined row.
So the padding past a batch's ids (groups with only some features, jagged batches under
`cuda_graphs`: all of it the sentinel slot, where it starts known on the device only) goes into
extra bags of at most `PADDING_BAG_IDS` ids, whose outputs are dropped (a zero gradient).

Host reads: none of a device tensor on the per-batch path. Bounds checks are off
(`BoundsCheckMode.NONE`: distcache checks ids itself). FBGEMM reads two host tensors (CPU
tensors on every device): the learning rate (a step applies the rate set when its lookup ran)
and, for row-wise Adagrad, its step counter `iter_cpu`, with `.item()` twice a forward. Its
first forward would also read the device's counter (`iter.cpu()`) while `iter_cpu` is 0: it
starts at 1 here (plain row-wise Adagrad does not use the count). `host_tensors` names them for
the device-path audit.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from distcache.cache.config import TBE_OPTIMIZERS
from distcache.errors import DistcacheConfigError

if TYPE_CHECKING:
    from distcache.cache.config import CacheConfig
    from distcache.cache.optimizers import RowOptimizer

#: At most this many padding ids share a bag (one warp's worth on CUDA).
PADDING_BAG_IDS = 32
_CUDA_MAX_DIM = 1024  # the widest rows FBGEMM's CUDA kernels are generated for


def tbe_unsupported(
    *, optimizer: str, dim: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Why FBGEMM's TBE cannot serve a cache of `dim`-wide `dtype` rows on `device` updated by
    `optimizer` as distcache defines it; None where it can. May import fbgemm_gpu (once)."""
    if optimizer not in TBE_OPTIMIZERS:
        return f"FBGEMM's TBE has no {optimizer!r} that keeps its state with the row"
    if dim < 4 or dim % 4:
        return f"FBGEMM's TBE needs rows whose width is a multiple of 4, not {dim}"
    if device.type not in ("cpu", "cuda"):
        return f"FBGEMM's TBE runs on CPU or CUDA, not {device.type}"
    if device.type == "cuda" and dim > _CUDA_MAX_DIM:
        return f"FBGEMM's CUDA TBE takes rows up to {_CUDA_MAX_DIM} wide, not {dim}"
    if dtype == torch.bfloat16:  # no CPU kernel (fbgemm_gpu 1.8); CUDA asserts (1.6)
        return "FBGEMM's TBE has no bfloat16 rows"
    return _fbgemm_unavailable(device.type)


def kernel_for(config: CacheConfig, device: torch.device, dtype: torch.dtype, dim: int) -> str:
    """The kernel (`CacheConfig.kernel`) that serves a cache of `dim`-wide `dtype` rows on
    `device`: by default torch's ops on CUDA and for SGD, FBGEMM's TBE where it can serve the
    cache otherwise.

    Raises:
        DistcacheConfigError: `kernel='fbgemm'` where FBGEMM's TBE cannot serve the cache.
    """
    by_default = device.type == "cuda" or config.optimizer == "sgd"
    if config.kernel == "torch" or (config.kernel is None and by_default):
        return "torch"
    reason = tbe_unsupported(optimizer=config.optimizer, dim=dim, dtype=dtype, device=device)
    if reason is None and dtype != torch.float32 and device.type == "cpu":
        if config.rounds_stochastically(device):  # (asked for: CPU's default is nearest)
            reason = "FBGEMM's CPU kernels round half rows to nearest, not stochastically"
    if reason is None:
        return "fbgemm"
    if config.kernel == "fbgemm":
        raise DistcacheConfigError(
            f"CacheConfig.kernel='fbgemm' cannot serve {dim}-wide {dtype} rows on "
            f"{device}: {reason}; use kernel='torch' or None"
        )
    return "torch"


@functools.cache
def _fbgemm_unavailable(device_type: str) -> str | None:
    """Why fbgemm_gpu cannot run TBE on `device_type` here; None where it can."""
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return "fbgemm_gpu is not installed"
    try:
        with _quiet():
            import fbgemm_gpu
            import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    except Exception as err:  # a broken install: the torch kernel serves, saying why
        return f"fbgemm_gpu does not import ({type(err).__name__}: {err})"
    if device_type == "cuda" and getattr(fbgemm_gpu, "__variant__", "cuda") == "cpu":
        return "this fbgemm_gpu is its CPU-only build"
    return None


class TbeKernel:
    """FBGEMM's TBE over one cache's slots: the cache's storage, its lookups, its fused update.

    Args:
        slots: rows of the cache (its capacity plus the sentinel and trash slots).
        dim: row width (a multiple of 4).
        dtype: the rows' dtype (the TBE's weight precision).
        config: the cache's settings (the optimizer and its eps).
        optimizer: the engine's row optimizer; its `lr` is read at every lookup, so that a
            changed learning rate (a scheduler's, through `CacheEngine.optimizer.lr`) reaches
            the TBE.
        device: where the rows live.
        pooled: sum each bag's rows (`CachedEmbeddingBags`), or return each id's row
            (`CachedEmbeddings`: FBGEMM's `PoolingMode.NONE`).
    """

    def __init__(
        self,
        *,
        slots: int,
        dim: int,
        dtype: torch.dtype,
        config: CacheConfig,
        optimizer: RowOptimizer,
        device: torch.device,
        pooled: bool,
    ):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        cuda = device.type == "cuda"
        where = (
            (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
            if cuda
            else (EmbeddingLocation.HOST, ComputeDevice.CPU)
        )
        precision = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}
        self.pooled = pooled
        self._optimizer = optimizer
        self._lr = optimizer.lr
        with _quiet():
            self.module = SplitTableBatchedEmbeddingBagsCodegen(
                [(slots, dim, *where)],
                feature_table_map=[0],
                optimizer=EmbOptimType[TBE_OPTIMIZERS[config.optimizer]],
                learning_rate=optimizer.lr,
                eps=config.eps,
                weights_precision=precision[dtype],
                output_dtype=SparseType.FP32,
                stochastic_rounding=config.rounds_stochastically(device),
                pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE,
                bounds_check_mode=BoundsCheckMode.NONE,
                device=device,
            )
        self.module.iter_cpu.fill_(1)  # no read of the device's counter (module docstring)
        place = "dev" if cuda else "host"
        self.weights = _alias(getattr(self.module, f"weights_{place}"), slots)  # [slots, dim]
        if config.optimizer == "sgd":
            self.state = torch.zeros(slots, 0, device=device)
        else:  # [slots, 1] row-wise, [slots, dim] element-wise
            self.state = _alias(getattr(self.module, f"momentum1_{place}"), slots)

    @property
    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors FBGEMM reads on the host at every step: CPU tensors on every device."""
        return (self.module.iter_cpu, self.module.learning_rate_tensor)

    def lookup(
        self,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        *,
        padded: bool = False,
    ) -> torch.Tensor:
        """The rows at `slots` `[n]` (int64), float32: summed per bag `[bags, dim]` if pooled,
        else one per id `[n, dim]`.

        `offsets` `[bags + 1]` delimits the bags; with `padded`, the ids past its last entry
        (on the device) are padding and read the sentinel slot. `weights` `[n]` (float32)
        scale each id's row in its bag. Under grad mode the result's backward is FBGEMM's
        fused update of the rows (`update`), at the optimizer's learning rate of this call.
        """
        lr = self._optimizer.lr
        if lr != self._lr:  # a CPU tensor's fill: no device work
            self.module.set_learning_rate(lr)
            self._lr = lr
        bags = offsets.numel() - 1
        if padded:
            offsets = _cover(offsets, slots.numel())
        out = self.module(slots, offsets, weights)
        return out[:bags] if padded and self.pooled else out

    def update(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply the optimizer to the rows a lookup read: FBGEMM's backward of `output` (what
        `lookup` returned, under grad mode) with the gradient `grad` of the same shape."""
        torch.autograd.grad(
            output, self.module.placeholder_autograd_tensor, grad, allow_unused=True
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """FBGEMM logs a dozen INFO lines on the root logger for every TBE it builds (its arguments,
    feature gates) and one for every library it loads: muted while it does."""
    previous = logging.root.manager.disable
    logging.disable(max(previous, logging.INFO))
    try:
        yield
    finally:
        logging.disable(previous)


def _alias(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """`flat`'s memory as `[rows, flat.numel() // rows]`, with a version counter of its own.

    FBGEMM's autograd saves its weight and state tensors for backward and checks that they were
    not modified in place in between; the stager does exactly that (other slots' rows, for the
    batches ahead), which is safe: the backward reads no row values, it updates rows in place.
    """
    cols = flat.numel() // rows
    out = torch.empty(0, dtype=flat.dtype, device=flat.device)
    return out.set_(flat.untyped_storage(), flat.storage_offset(), (rows, cols), (cols, 1))


def _cover(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """`offsets` `[bags + 1]` and after them bags that hold the ids past `offsets[-1]` (padding),
    at most `PADDING_BAG_IDS` each, so that every one of the `n` ids is in a bag. Computed on
    the device, where alone it is known where the padding starts."""
    extra = max(1, -(-n // PADDING_BAG_IDS))
    ends = torch.arange(1, extra + 1, device=offsets.device) * PADDING_BAG_IDS  # [extra]
    return torch.cat([offsets, torch.maximum(ends.clamp_(max=n), offsets[-1:])])
