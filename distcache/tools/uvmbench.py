"""The timed UVM cache of `python -m distcache calibrate --device cuda`: what FBGEMM's own cache
costs the device per id, for the cost model's reactive caches on a GPU.

TorchRec's `fused_uvm_caching` keeps a table's rows in host-mapped memory and an LRU cache of
some of them in HBM (FBGEMM's TBE with `EmbeddingLocation.MANAGED_CACHING`). Each training step
it finds the batch's rows in the cache, evicts and inserts its misses (`lru_cache_populate`,
`lru_cache_insert_kernel`), then looks the rows up and updates them as its every-row-in-HBM
kernel does. `measure_uvm_cache_costs` times that step against the same TBE with every row in
HBM on the same batches, as the device's work (`devicetime`), at two batch sizes and, at the
larger, two cache sizes, and prices the difference per id of a step and per row the cache
loads (`fit_uvm_costs`): `Topology.reactive_cache_s_per_id` and `reactive_cache_s_per_miss`.
The misses are the cost model's own (`binned`'s LRU model of the batches' power law), so the
model prices a cache's misses as the fit counted them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distcache.planner.binned import table_access
from distcache.planner.types import TableStats
from distcache.tools.devicetime import device_seconds
from distcache.tools.microbench import FULL, power_law_batches

WARM_STEPS = 20
"""Steps before timing: the cache fills (and the LRU turns over) on fresh batches."""


@dataclass(frozen=True)
class UVMCacheCosts:
    """`fit_uvm_costs`' figures; None where the noise left one <= 0."""

    s_per_id: float | None
    """Device seconds per id of a step (`Topology.reactive_cache_s_per_id`)."""
    s_per_miss: float | None
    """Device seconds per row loaded (`Topology.reactive_cache_s_per_miss`); None: the misses
    are in `s_per_id` (as at the fraction measured)."""


def measure_uvm_cache_costs(
    *,
    rows: int = FULL.lookup_rows,
    dim: int = FULL.lookup_dims[-1],
    bags: Sequence[int] = FULL.lookup_bags,
    pooling: int = FULL.lookup_pooling,
    alpha: float = FULL.lookup_alpha,
    fractions: tuple[float, float] = (0.05, 0.2),
    repeats: int = 5,
    device: str = "cuda",
) -> UVMCacheCosts:
    """FBGEMM's UVM cache's own device work: a training step (SGD) of a TBE whose `rows` live
    in host-mapped memory behind an LRU cache, less the same step with every row in HBM, on
    fresh power-law batches once the cache is warm; at the fewest and most of `bags` with a
    cache of `fractions[0]` of the rows, and at the most with one of `fractions[1]`
    (`fit_uvm_costs`: the step's fixed part, launches and such, cancels).

    Raises:
        NotImplementedError: not on CUDA (FBGEMM's UVM cache is CUDA only).
        ImportError: no fbgemm_gpu.
    """
    if torch.device(device).type != "cuda":
        raise NotImplementedError("FBGEMM's UVM cache runs on CUDA only")
    few, most = min(bags), max(bags)
    points = ((few, fractions[0]), (most, fractions[0]), (most, fractions[1]))
    base = {b: _uvm_step(rows, dim, b, pooling, alpha, None, repeats) for b in (few, most)}
    extra = [_uvm_step(rows, dim, b, pooling, alpha, f, repeats) - base[b] for b, f in points]
    access = table_access(TableStats(name="uvm", rows=rows, dim=dim, alpha=alpha))
    misses = [access.loads(b * pooling, math.ceil(f * rows), "lru") for b, f in points]
    return fit_uvm_costs((few * pooling, most * pooling), misses, extra)


def fit_uvm_costs(
    ids: tuple[float, float], misses: Sequence[float], extra: Sequence[float]
) -> UVMCacheCosts:
    """Seconds per id and per miss of a cache whose extra step time is fixed + ids·a +
    misses·b, from three steps: `ids[0]` and `ids[1]` ids at one cache size, then `ids[1]` at
    another (`misses` and `extra`: each step's). b from the two cache sizes, a from the two
    batches less their misses' share; b None where it comes out <= 0 (a then the plain slope
    per id, misses included), both None where that slope is <= 0 too."""
    slope = (extra[1] - extra[0]) / (ids[1] - ids[0])
    gap = misses[2] - misses[1]
    per_miss = (extra[2] - extra[1]) / gap if gap else 0.0
    if per_miss > 0:
        per_id = slope - per_miss * (misses[1] - misses[0]) / (ids[1] - ids[0])
        if per_id > 0:
            return UVMCacheCosts(float(per_id), float(per_miss))
    return UVMCacheCosts(float(slope) if slope > 0 else None, None)


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
