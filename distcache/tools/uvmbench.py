"""The timed UVM cache of `python -m distcache calibrate --device cuda`: what FBGEMM's own cache
costs the device per id, for the cost model's reactive caches on a GPU.

TorchRec's `fused_uvm_caching` keeps a table's rows in host-mapped memory and an LRU cache of
some of them in HBM (FBGEMM's TBE with `EmbeddingLocation.MANAGED_CACHING`). Each training step
it finds the batch's rows in the cache, evicts and inserts its misses (`lru_cache_populate`,
`lru_cache_insert_kernel`), then looks the rows up and updates them as its every-row-in-HBM
kernel does. `measure_uvm_cache_costs` times that step against the same TBE with every row in
HBM on the same batches, as the device's work (`devicetime`), and prices the difference per id
of a step: `Topology.reactive_cache_s_per_id`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distcache.tools.devicetime import device_seconds
from distcache.tools.microbench import FULL, power_law_batches

WARM_STEPS = 20
"""Steps before timing: the cache fills (and the LRU turns over) on fresh batches."""


def measure_uvm_cache_costs(
    *,
    rows: int = FULL.lookup_rows,
    dim: int = FULL.lookup_dims[-1],
    bags: Sequence[int] = FULL.lookup_bags,
    pooling: int = FULL.lookup_pooling,
    alpha: float = FULL.lookup_alpha,
    fraction: float = 0.05,
    repeats: int = 5,
    device: str = "cuda",
) -> float | None:
    """Device seconds per id of FBGEMM's UVM cache's own work: at each of `bags` (>= 2), a
    training step (SGD) of a TBE whose `rows` live in host-mapped memory behind an LRU cache
    of `fraction` of them, less the same step with every row in HBM, on fresh power-law
    batches once the cache is warm; fitted as a slope over the steps' ids (its fixed part,
    launches and such, is the step's). None where the noise leaves the slope <= 0.

    Raises:
        NotImplementedError: not on CUDA (FBGEMM's UVM cache is CUDA only).
        ImportError: no fbgemm_gpu.
    """
    if torch.device(device).type != "cuda":
        raise NotImplementedError("FBGEMM's UVM cache runs on CUDA only")
    extra = []
    for b in bags:
        seconds = [_uvm_step(rows, dim, b, pooling, alpha, f, repeats) for f in (fraction, None)]
        extra.append(seconds[0] - seconds[1])
    ids = [b * pooling for b in bags]
    slope = (extra[-1] - extra[0]) / (ids[-1] - ids[0])
    return float(slope) if slope > 0 else None


def _uvm_step(
    rows: int, dim: int, bags: int, pooling: int, alpha: float, fraction: float | None, repeats: int
) -> float:
    """Median device seconds of a TBE's training step: its rows behind a UVM cache of
    `fraction` of them (host-mapped, LRU), or every row in HBM (None)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        CacheAlgorithm,
        EmbeddingLocation,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    dev = torch.device("cuda", torch.cuda.current_device())  # (TBE keeps the index it is given)
    cache = {}
    location = EmbeddingLocation.DEVICE
    if fraction is not None:  # as TorchRec's fused_uvm_caching: host-mapped, never managed
        location = EmbeddingLocation.MANAGED_CACHING
        cache = {"cache_algorithm": CacheAlgorithm.LRU, "cache_load_factor": fraction}
        cache["uvm_host_mapped"] = True
    kernel = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, location, ComputeDevice.CUDA)],
        optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01, device=dev, **cache,
    )  # fmt: skip
    # Fresh batches every step (the same seed for both TBEs): a cycle of a few would all hit.
    count = WARM_STEPS + 4 * repeats
    batches, offsets = power_law_batches(rows, alpha, bags, pooling, count, dim, dev)
    step = iter(batches)

    def train() -> None:
        kernel(next(step), offsets).sum().backward()

    return device_seconds(train, dev, repeats, warmup=WARM_STEPS)
