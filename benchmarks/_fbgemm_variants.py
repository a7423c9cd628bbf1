"""FBGEMM's table-batched embedding (TBE) as `gpu_headline.py`'s baselines, without TorchRec.

Each variant is one `SplitTableBatchedEmbeddingBagsCodegen` over all the tables (TorchRec's fused
kernels group the tables of one width into one TBE): fp32 rows, the optimizer fused into the
backward (`EXACT_SGD`, or `EXACT_ROWWISE_ADAGRAD` with distcache's eps), no stochastic rounding,
rows filled by the caller (the headline's tiled block, so every variant starts from the same
weights), the same dense part, batches and SGD on it as the other variants:

- fbgemm_device: every row in device memory (`EmbeddingLocation.DEVICE`): TorchRec's `fused`.
  On a CPU run `EmbeddingLocation.HOST` on `ComputeDevice.CPU`, TorchRec's `fused` there.
- fbgemm_uvm (CUDA only): the rows in page-locked host memory that the device addresses
  (`uvm_host_mapped=True`: malloc + cudaHostRegister; managed memory larger than the device's
  can hang these GPUs), an LRU cache of `cache_load_factor` = the capacity of them in device
  memory (`EmbeddingLocation.MANAGED_CACHING`): TorchRec's `fused_uvm_caching`. Each forward
  loads its batch's misses into the cache (`lru_cache_populate`) on the compute stream.
- fbgemm_uvm_prefetch (CUDA only): the same with `prefetch_pipeline=True`, driven as TorchRec's
  `PrefetchTrainPipelineSparseDist` drives it: right after batch t's forward is launched, batch
  t+1's misses are loaded on a side stream (`prefetch(..., forward_stream=<compute stream>)`,
  which records the cache locations it makes on the compute stream), overlapping batch t's
  dense part. FBGEMM orders the rest: batch t's rows stay locked in the cache until its
  backward, whose pre-hook makes the compute stream wait for the side stream and looks batch
  t's rows up again (rows the prefetch inserted); after the backward the side stream waits for
  the compute stream (`_sync_stream_post_backward`). The compute stream also waits for the
  side stream before each forward, as TorchRec's `_wait_for_batch` does.

FBGEMM is imported only when a variant is built. The API used here is the same in fbgemm-gpu
1.6.0 (the GPU machine's CUDA build) and 1.8.0 (the CPU build here): the constructor's keywords,
`prefetch(indices, offsets, forward_stream)`, `split_embedding_weights()`, `lxu_cache_state`
(`[sets, 32]`, -1 where a slot is empty) and the enums' modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from _headline_step import dense_and_backward, phase
from torch import nn

from distcache import CacheConfig, TableSpec

FBGEMM_VARIANTS = ("fbgemm_device", "fbgemm_uvm", "fbgemm_uvm_prefetch")
FBGEMM_CACHED = ("fbgemm_uvm", "fbgemm_uvm_prefetch")
FULL_FRACTION = 0.99  # a cache with this fraction of its slots holding rows counts as full
_OPTIMIZERS = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}


@dataclass
class TBEVariant:
    """A built FBGEMM variant: `step(t)` trains batch t and returns its loss (on the device);
    `full()` says whether its cache is full (None: no cache); `info` goes to the results."""

    step: Callable[[int], torch.Tensor]
    full: Callable[[], bool] | None
    info: dict = field(default_factory=dict)


def unavailable(name: str, device: torch.device, optimizer: str) -> str | None:
    """Why FBGEMM variant `name` cannot run here, or None."""
    if name in FBGEMM_CACHED and device.type != "cuda":
        return "FBGEMM's UVM cache (EmbeddingLocation.MANAGED_CACHING) runs on CUDA only"
    if optimizer not in _OPTIMIZERS:
        return f"no FBGEMM optimizer mapped for {optimizer!r}: expected one of {tuple(_OPTIMIZERS)}"
    try:
        import fbgemm_gpu
    except Exception as err:  # ImportError, or OSError from a library that does not load
        return f"fbgemm_gpu does not import: {type(err).__name__}: {str(err)[:200]}"
    if device.type == "cuda" and getattr(fbgemm_gpu, "__variant__", "") == "cpu":
        return (
            "fbgemm_gpu is its CPU build (fbgemm-gpu-cpu), without CUDA kernels: carry .fbg "
            "(../shared/device/fbgemm_cuda.sh) and unpack it before .whl"
        )
    return None


def describe() -> str | None:
    """The installed fbgemm_gpu's version and build ('1.6.0 cuda'), or None."""
    try:
        import fbgemm_gpu
    except Exception:
        return None
    return f"{getattr(fbgemm_gpu, '__version__', '?')} {getattr(fbgemm_gpu, '__variant__', '?')}"


def build(
    name: str,
    capacity: float | None,
    tables: Sequence[TableSpec],
    data,
    dense_model: nn.Module,
    config: CacheConfig,
    init: Callable[[torch.Tensor, int], None],
    device: torch.device,
) -> TBEVariant:
    """Build FBGEMM variant `name` (one of FBGEMM_VARIANTS) and its training step.

    Args:
        capacity: the cache's fraction of the rows (`cache_load_factor`), for the UVM variants.
        data: the headline's `Data` (`values(t)` `[F * B]` feature-major ids, `offsets`
            `[F * B + 1]`, `dense`, `labels`).
        config: the embeddings' optimizer: `optimizer`, `learning_rate`, `eps`.
        init: fills one table's rows `[rows, dim]` in place, given its row count.
    """
    tbe = _make_tbe(name, capacity, tables, config, device)
    with torch.no_grad():
        for spec, weight in zip(tables, tbe.split_embedding_weights(), strict=True):
            init(weight, spec.num_embeddings)  # views of the TBE's own (host-mapped) rows
    dense_opt = torch.optim.SGD(dense_model.parameters(), lr=config.learning_rate)
    if name == "fbgemm_uvm_prefetch":
        step = _prefetching_step(tbe, data, dense_model, dense_opt, device)
    else:
        step = _step(tbe, data, dense_model, dense_opt)
    if name not in FBGEMM_CACHED:
        return TBEVariant(step, None)
    state = tbe.lxu_cache_state  # [sets, 32] int64: the row in each slot, -1 if empty

    def full() -> bool:
        torch.cuda.synchronize(device)  # the side stream may be filling the cache
        return int((state >= 0).sum()) >= FULL_FRACTION * state.numel()

    return TBEVariant(step, full, {"cache_rows": float(state.numel())})


def _make_tbe(name, capacity, tables, config, device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        CacheAlgorithm,
        ComputeDevice,
        EmbeddingLocation,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    cuda = device.type == "cuda"
    if name in FBGEMM_CACHED:
        location = EmbeddingLocation.MANAGED_CACHING
        cache = {
            "cache_algorithm": CacheAlgorithm.LRU,
            "cache_load_factor": capacity,
            "uvm_host_mapped": True,  # pinned host rows; never cudaMallocManaged here
            "prefetch_pipeline": name == "fbgemm_uvm_prefetch",
        }
    else:
        location = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
        cache = {}
    compute = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
    if cuda:  # TBE keeps the device it is given: name the index, as TorchRec does
        device = torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, location, compute) for t in tables],
        optimizer=getattr(EmbOptimType, _OPTIMIZERS[config.optimizer]),
        learning_rate=config.learning_rate,
        eps=config.eps,
        stochastic_rounding=False,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        device=device,
        **cache,
    )


def _step(tbe, data, dense_model, dense_opt) -> Callable[[int], torch.Tensor]:
    def step(t: int) -> torch.Tensor:
        with phase("forward"):
            pooled = tbe(data.values(t), data.offsets)  # [B, F * D]
        return dense_and_backward(t, pooled, data, dense_model, dense_opt)

    return step


def _prefetching_step(tbe, data, dense_model, dense_opt, device) -> Callable[[int], torch.Tensor]:
    """Batch t+1's rows prefetched on a side stream after batch t's forward (module docstring).
    Batches train in order: a step that skips one raises."""
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(compute)  # the rows written while building
    batches = data.ids.shape[0]
    ahead: list[int | None] = [None]  # the batch whose rows are prefetched

    def prefetch(t: int) -> None:
        with phase("stage"), torch.cuda.stream(side):
            tbe.prefetch(data.values(t), data.offsets, forward_stream=compute)
        ahead[0] = t

    def step(t: int) -> torch.Tensor:
        if ahead[0] is None:
            prefetch(t)  # the first batch
        elif ahead[0] != t:
            raise RuntimeError(f"batch {ahead[0]} is prefetched, but batch {t} trains")
        with phase("forward"):
            compute.wait_stream(side)
            pooled = tbe(data.values(t), data.offsets)  # [B, F * D]
        ahead[0] = None
        if t + 1 < batches:
            prefetch(t + 1)
        return dense_and_backward(t, pooled, data, dense_model, dense_opt)

    return step
