"""`python -m distcache calibrate`: measure this machine and write a `Topology` JSON.

Each measurement is a small function returning one number (or one fit), so each can be tested
and re-used on its own:

- `measure_copy_bandwidth`: bytes/s of a large tensor copy on the compute device.
- `measure_host_to_device_bandwidth`: bytes/s from pinned host memory to the GPU (CUDA only).
- `measure_lookup_costs`: a training step of distcache's cache kernel (look-ahead window,
  every row resident, power-law ids), timed at two batch sizes and two widths and fitted as
  `seconds = fixed + row accesses / rows_per_s + bytes / bytes_per_s`, row accesses and bytes
  counted as the cost model counts them (2 per id, 2 per distinct row); the fixed part is the
  kernel's share of `sharding_overhead_s`, measured below with the rest of the framework.
- `measure_dense_flops`: achieved FLOP/s of a wide MLP forward + backward (compute-bound).
- `measure_dense_layer_overhead`: seconds per layer of an MLP too small to compute anything
  (forward, backward, SGD update): the dispatch cost of a layer.
- `measure_activation_bandwidth`: bytes/s of the memory-bound activation traffic of a narrow,
  deep MLP on a large batch, once its flops and layer overheads are taken out.
- `measure_staging_costs`: what a partial cache's misses add to a step, fitted as bytes
  moved (loads and write-backs, with the scheduler's work: the host-to-device rate on CPU)
  plus the slots it scores once per batch to pick victims.
- `measure_collectives`: gloo all-to-all and all-reduce between the local ranks, fitted as
  `time = latency + bytes / bandwidth` over several message sizes; `measure_sync_latency`:
  what a collective costs between compute bursts, when peers compete for the cores.
- `distcache.job.measure.measure_framework_costs` (CPU): tiny DLRM plans trained for real,
  giving the framework's fixed costs per step and per sharding type and the bytes/s of a
  data-parallel table's dense update.

`calibrate` runs them all and `topology_from` turns the results into a `Topology`. On CPU the
compute measurements run in every rank at once (each with its share of the cores), as the
ranks of a job compete for cores and memory; each figure is the mean over ranks. On CPU the
"device" is host memory: device and host memory are the same pool (each is MemAvailable /
ranks; a planner must not fill both). On one machine the inter-node figures equal the
intra-node ones; one rank has no network to measure, so its figures are the CPU preset's. The
network is measured with gloo over host tensors on CUDA machines too (an NCCL measurement
needs one GPU per rank); there only rank 0 measures compute, and the CPU-only figures (layer
and framework overheads, activation and dense-update rates) keep their GPU defaults.

Example::

    python -m distcache calibrate --ranks 2 --out topology.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distcache.errors import DistcacheConfigError
from distcache.job.measure import (
    MeasureOptions,
    free_port,
    measure_framework_costs,
    run_ranks,
)
from distcache.planner.cost import ACTIVATION_IN_PASSES, ACTIVATION_OUT_PASSES
from distcache.planner.topology import preset
from distcache.planner.types import Topology

__all__ = [
    "CalibrationSizes",
    "LinkFit",
    "Measurements",
    "calibrate",
    "LookupCosts",
    "StagingCosts",
    "fit_latency_bandwidth",
    "main",
    "measure_activation_bandwidth",
    "measure_collectives",
    "measure_copy_bandwidth",
    "measure_copy_latency",
    "measure_dense_flops",
    "measure_dense_layer_overhead",
    "measure_host_to_device_bandwidth",
    "measure_lookup_costs",
    "measure_staging_costs",
    "measure_sync_latency",
    "topology_from",
]

_MIB = 1 << 20


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise DistcacheConfigError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class CalibrationSizes:
    """Problem sizes of the measurements; `FULL` for a real calibration, `QUICK` for tests."""

    copy_bytes: int = 256 * _MIB
    """Size of the copied tensor (two of them are allocated)."""
    lookup_rows: int = 500_000
    lookup_dims: tuple[int, ...] = (16, 64)
    """Widths the lookup is timed at (>= 2 to tell per-row from per-byte costs)."""
    lookup_bags: tuple[int, ...] = (512, 2048)
    """Bags per step the lookup is timed at (>= 2 to tell fixed from per-row costs)."""
    lookup_pooling: int = 4
    """Ids per bag; a step looks up bags * lookup_pooling rows."""
    lookup_alpha: float = 1.05
    """Power-law exponent of the lookup's ids (the planner's default access profile)."""
    staging_capacities: tuple[float, ...] = (0.02, 0.05, 0.1)
    """Cache fractions `measure_staging_costs` times (each must hold 2 batches' rows)."""
    mlp_batch: int = 2048
    mlp_widths: tuple[int, ...] = (512, 1024, 1024, 512, 256)
    """Layer widths, input first: an MLP of len - 1 linear layers."""
    activation_batch: int = 4096
    activation_widths: tuple[int, ...] = (8, 1024, 8, 1024, 8)
    """A narrow, deep MLP whose time is mostly activation traffic."""
    message_bytes: tuple[int, ...] = tuple(4096 << (2 * i) for i in range(8))  # 4 KiB .. 64 MiB
    repeats: int = 5
    """Timed repetitions of each compute measurement (the median is kept)."""
    framework_rows: int = 250_000
    """Rows of the data-parallel table whose dense update `measure_framework_costs` times:
    16 MB, a size replicated tables have (one that outgrows the last-level cache updates
    slower: here 1.6 GB/s at 16-32 MB, 1.0 GB/s at 64 MB)."""
    framework_batch: int = 512
    """Batch of the run that times the framework's cost per id."""
    framework_steps: int = 30
    framework_warmup: int = 10

    def __post_init__(self) -> None:
        for name in ("copy_bytes", "lookup_rows", "lookup_pooling", "mlp_batch", "repeats"):
            _check_positive(name, getattr(self, name))
        for name in ("activation_batch", "framework_steps", "framework_rows", "framework_batch"):
            _check_positive(name, getattr(self, name))
        for name in ("lookup_dims", "lookup_bags"):
            values = getattr(self, name)
            if len(set(values)) < 2 or min(values) < 1:
                raise DistcacheConfigError(f"{name} must hold >= 2 distinct sizes >= 1: {values}")
        for name in ("mlp_widths", "activation_widths"):
            widths = getattr(self, name)
            if len(widths) < 2 or min(widths) < 1:
                raise DistcacheConfigError(f"{name} must hold >= 2 widths, each >= 1, got {widths}")
        if len(self.message_bytes) < 2 or min(self.message_bytes) < 64:
            raise DistcacheConfigError(
                f"message_bytes must hold >= 2 sizes, each >= 64, got {self.message_bytes}"
            )


FULL = CalibrationSizes()
QUICK = CalibrationSizes(
    copy_bytes=16 * _MIB,
    lookup_rows=20_000,
    lookup_dims=(8, 32),
    lookup_bags=(64, 256),
    staging_capacities=(0.2, 0.4, 0.8),
    mlp_batch=256,
    mlp_widths=(128, 256, 128),
    activation_batch=512,
    activation_widths=(8, 256, 8),
    message_bytes=(1024, 16 * 1024, 256 * 1024),
    repeats=3,
    framework_rows=50_000,
    framework_batch=128,
    framework_steps=6,
    framework_warmup=2,
)


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """A link modelled as `seconds = latency_s + bytes / bw_bytes_per_s` (bytes a rank sends)."""

    latency_s: float
    bw_bytes_per_s: float


@dataclass(frozen=True, kw_only=True)
class LookupCosts:
    """A cache-kernel step: `fixed_s + accesses / rows_per_s + bytes / bytes_per_s`."""

    rows_per_s: float
    bytes_per_s: float | None
    """None where the widths measured did not tell bytes from rows (noise)."""
    fixed_s: float


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Raw results of `calibrate`, per rank (the mean over ranks on CPU)."""

    device: str
    ranks: int
    threads_per_rank: int
    copy_bw_bytes_per_s: float
    host_to_device_bw_bytes_per_s: float
    host_to_device_latency_s: float
    lookup_rows_per_s: float
    lookup_bytes_per_s: float | None
    cache_scan_rows_per_s: float | None = None
    dense_flops_per_s: float
    dense_layer_overhead_s: float
    dense_activation_bytes_per_s: float | None
    all_to_all: LinkFit | None
    """None on one rank (no network)."""
    all_reduce: LinkFit | None
    sync_latency_s: float | None = None
    """`measure_sync_latency`; None on one rank."""
    device_memory_bytes: int
    host_memory_bytes: int
    step_overhead_s: float = 0.0
    sharding_overhead_s: float = 0.0
    id_overhead_s: float = 0.0
    dense_update_bytes_per_s: float | None = None
    """CPU only (`measure_framework_costs`); the GPU defaults elsewhere."""
    seconds: float = field(default=0.0, compare=False)
    """Wall time of the whole calibration."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall seconds of `fn()` after one warm-up call (CUDA events on the GPU)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def measure_copy_bandwidth(
    *, nbytes: int = FULL.copy_bytes, repeats: int = 5, device: str = "cpu"
) -> float:
    """Bytes copied per second by `dst.copy_(src)` with both tensors on `device`.

    The memory traffic is twice this (each byte is read and written): `topology_from` reports
    that as the device memory bandwidth, the STREAM "copy" convention.

    Args:
        nbytes: Size of each tensor; use one well beyond the last-level cache.
        repeats: Timed copies; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    dev = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    return src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), dev, repeats)


def measure_host_to_device_bandwidth(*, nbytes: int = FULL.copy_bytes, repeats: int = 5) -> float:
    """Bytes/s of a copy from pinned host memory to the current CUDA device.

    Args:
        nbytes: Size of the copied tensor.
        repeats: Timed copies; the median is kept.
    """
    dev = torch.device("cuda")
    src = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
    dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
    seconds = _median_seconds(lambda: dst.copy_(src, non_blocking=True), dev, repeats)
    return src.numel() * 4 / seconds


def measure_copy_latency(*, device: str = "cpu", repeats: int = 50) -> float:
    """Seconds of a 4-byte host-to-device copy: the fixed cost of one staging transfer.

    On CUDA the source is pinned and the copy is asynchronous, as the stager issues it; on CPU
    it is a plain copy (mostly dispatch overhead).

    Args:
        device: 'cpu' or 'cuda'.
        repeats: Timed copies; the median is kept.
    """
    dev = torch.device(device)
    src = torch.ones(1)
    src = src.pin_memory() if dev.type == "cuda" else src
    dst = torch.empty(1, device=dev)
    return _median_seconds(lambda: dst.copy_(src, non_blocking=True), dev, repeats)


def _lookup_step(
    *, rows: int, dim: int, bags: int, pooling: int, alpha: float, repeats: int, device: str
) -> tuple[float, float]:
    """(median seconds, mean distinct rows) of a training step of distcache's cache kernel on
    one table with every row resident: the next batch enters the look-ahead window and is
    staged, the batch is looked up (sum-pooled) and its rows updated (SGD) in backward."""
    from distcache.cache.config import CacheConfig
    from distcache.cache.module import CachedEmbeddingBags, TableSpec
    from distcache.data.traces import zipf_trace

    dev = torch.device(device)
    config = CacheConfig(capacity=1.0, lookahead=1, prefetch_depth=1, check_ids=False)
    table = TableSpec(name="t", num_embeddings=rows, embedding_dim=dim)
    kernel = CachedEmbeddingBags([table], config, device=dev)
    every, whole = torch.arange(rows, device=dev), torch.tensor([0, rows], device=dev)
    kernel.enqueue(every, whole)  # load every row: the steps below only look up and update
    kernel(every, whole).sum().backward()
    n = bags * pooling
    trace = zipf_trace(rows=rows, alpha=alpha, batch=n, batches=repeats + 3, seed=dim)
    batches = [ids.to(dev) for ids in trace]  # [n] each
    offsets = torch.arange(0, n + 1, pooling, device=dev)  # [bags + 1]
    kernel.enqueue(batches[0], offsets)
    step = iter(range(len(batches) - 1))

    def train() -> None:
        i = next(step)
        kernel.enqueue(batches[i + 1], offsets)
        kernel.prefetch()
        kernel(batches[i], offsets).sum().backward()

    seconds = _median_seconds(train, dev, repeats)
    unique = statistics.mean(int(b.unique().numel()) for b in batches)
    return seconds, unique


@dataclass(frozen=True, kw_only=True)
class StagingCosts:
    """A partial cache's extra time per step: `moved bytes / bytes_per_s + slots /
    scan_rows_per_s` (its victims are picked by scoring every slot once per batch)."""

    bytes_per_s: float | None
    """None where no partial cache was measurably slower than a whole one (noise)."""
    scan_rows_per_s: float | None
    """None where the capacities measured did not tell scanning from moving (noise)."""


def measure_staging_costs(
    *,
    rows: int = FULL.lookup_rows,
    dim: int = FULL.lookup_dims[0],
    bags: int = FULL.lookup_bags[-1],
    pooling: int = FULL.lookup_pooling,
    alpha: float = FULL.lookup_alpha,
    capacities: Sequence[float] = FULL.staging_capacities,
    lookahead: int = 8,
    repeats: int = 5,
    device: str = "cpu",
) -> StagingCosts:
    """What a cache's misses cost per step, as the cost model counts it: look-ahead caches of
    each of `capacities` (fractions of the rows; L = `lookahead`, the solver's default, K = 1)
    and one holding every row train on the same power-law batches; each partial cache's extra
    time per step is fitted as `bytes moved (loads + write-backs) / bytes_per_s + its slots /
    scan_rows_per_s`.

    On CPU this, not a plain copy, is the host-to-device rate: a miss also costs the
    scheduler's look-ahead bookkeeping and the gathers and scatters of rows and their maps,
    and once full the cache scores every slot to pick each batch's victims. (A reactive LRU
    cache does less bookkeeping: its misses cost less.)

    Args:
        rows, pooling, alpha, device: as in `measure_lookup_costs`.
        dim: Embedding dimension.
        bags: Bags per step.
        capacities: >= 2 cache sizes, fractions of the rows (each must hold 2 batches' rows).
        lookahead: batches in the look-ahead window.
        repeats: 4 x repeats steps are timed, after 8 x repeats that fill the cache.
    """
    kw = {"rows": rows, "dim": dim, "bags": bags, "pooling": pooling, "alpha": alpha}
    kw |= {"lookahead": lookahead, "repeats": repeats, "device": device}
    whole, _ = _cached_steps(capacity=1.0, **kw)
    points = []  # (extra seconds, bytes moved, slots) of the caches that were slower
    for fraction in capacities:
        seconds, moved = _cached_steps(capacity=fraction, **kw)
        if seconds > whole and moved > 0:
            points.append((seconds - whole, moved, math.ceil(fraction * rows)))
    if not points:  # lost in the noise
        return StagingCosts(bytes_per_s=None, scan_rows_per_s=None)
    t, moved, slots = (np.array(c, dtype=np.float64) for c in zip(*points, strict=True))
    if len(points) >= 2:
        design = np.stack([moved, slots], axis=1) / t[:, None]  # relative errors
        (per_byte, per_slot), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
        if per_byte > 0 and per_slot > 0:
            return StagingCosts(
                bytes_per_s=float(1 / per_byte), scan_rows_per_s=float(1 / per_slot)
            )
    return StagingCosts(bytes_per_s=float(moved.sum() / t.sum()), scan_rows_per_s=None)


def _cached_steps(
    *, rows: int, dim: int, bags: int, pooling: int, alpha: float, capacity: float,
    lookahead: int, repeats: int, device: str = "cpu",
) -> tuple[float, float]:  # fmt: skip
    """(median seconds, bytes moved) per training step of a cache kernel fed `lookahead`
    batches ahead; a cache of every row is loaded whole first."""
    from distcache.cache.config import CacheConfig
    from distcache.cache.module import CachedEmbeddingBags, TableSpec
    from distcache.data.traces import zipf_trace

    dev = torch.device(device)
    config = CacheConfig(capacity=capacity, lookahead=lookahead, prefetch_depth=1, check_ids=False)
    table = TableSpec(name="t", num_embeddings=rows, embedding_dim=dim)
    kernel = CachedEmbeddingBags([table], config, device=dev)
    if capacity >= 1.0:
        engine = kernel.engines[0]
        engine.enqueue(torch.arange(rows, device=dev))
        engine.release(engine.lookup_plan())
    n, warm, steps = bags * pooling, 8 * repeats, 4 * repeats
    trace = zipf_trace(rows=rows, alpha=alpha, batch=n, batches=warm + steps + lookahead, seed=1)
    batches = [ids.to(dev) for ids in trace]  # [n] each
    offsets = torch.arange(0, n + 1, pooling, device=dev)  # [bags + 1]
    for ids in batches[:lookahead]:
        kernel.enqueue(ids, offsets)
    times, before = [], kernel.stats()["t"]
    for i in range(warm + steps):
        if i == warm:
            before = kernel.stats()["t"]
        _sync(dev)
        start = time.perf_counter()
        kernel.enqueue(batches[i + lookahead], offsets)
        kernel.prefetch()
        kernel(batches[i], offsets).sum().backward()
        _sync(dev)
        times.append(time.perf_counter() - start)
    after = kernel.stats()["t"]
    moved = after.bytes_loaded + after.bytes_written - before.bytes_loaded - before.bytes_written
    return statistics.median(times[warm:]), moved / steps


def measure_lookup_costs(
    *,
    rows: int = FULL.lookup_rows,
    dims: Sequence[int] = FULL.lookup_dims,
    bags: Sequence[int] = FULL.lookup_bags,
    pooling: int = FULL.lookup_pooling,
    alpha: float = FULL.lookup_alpha,
    repeats: int = 5,
    device: str = "cpu",
) -> LookupCosts:
    """A training step of distcache's cache kernel on one table with every row resident (the
    next batch enters the look-ahead window, the batch is looked up and its rows updated by
    SGD in backward), timed at every (dim, bags) and fitted by least relative squares as
    `fixed + accesses / rows_per_s + bytes / bytes_per_s`, counted as the cost model counts
    them: 2 accesses per id (gather, gradient) and 2 per distinct row (read and write in the
    update); bytes = accesses·dim·4.

    A per-byte cost the noise makes non-positive is dropped (bytes_per_s None) and the rest
    refitted; a non-positive per-row cost falls back to the largest step's average rate.

    Args:
        rows: Table rows (every row resident: twice `rows * dim * 4` bytes).
        dims: Widths timed (>= 2).
        bags: Bags per step timed (>= 2).
        pooling: Ids per bag.
        alpha: Power-law exponent of the ids.
        repeats: Timed steps of each size; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    points = []  # (seconds, accesses, bytes)
    for dim in dims:
        for b in bags:
            seconds, unique = _lookup_step(
                rows=rows, dim=dim, bags=b, pooling=pooling, alpha=alpha, repeats=repeats,
                device=device,
            )  # fmt: skip
            ids = b * pooling
            points.append((seconds, 2 * ids + 2 * unique, (2 * ids + 2 * unique) * dim * 4))
    t, accesses, traffic = (np.array(c, dtype=np.float64) for c in zip(*points, strict=True))
    for columns in ((np.ones_like(t), accesses, traffic), (np.ones_like(t), accesses)):
        design = np.stack(columns, axis=1) / t[:, None]  # relative errors: sizes span decades
        coef, *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
        if coef[-1] > 0 and coef[1] > 0:
            break
    per_row = coef[1] if coef[1] > 0 else float(t.max() / accesses[t.argmax()])
    per_byte = float(coef[2]) if len(coef) == 3 and coef[2] > 0 else None
    return LookupCosts(
        rows_per_s=float(1.0 / per_row),
        bytes_per_s=None if per_byte is None else 1.0 / per_byte,
        fixed_s=max(0.0, float(coef[0])),
    )


def measure_dense_flops(
    *,
    batch: int = FULL.mlp_batch,
    widths: Sequence[int] = FULL.mlp_widths,
    repeats: int = 5,
    device: str = "cpu",
) -> float:
    """Achieved FLOP/s of an MLP (Linear + ReLU layers) forward + backward.

    Counted as 6 * batch * in * out per layer: 2 for the forward matmul, 4 for the two backward
    ones (input and weight gradients); bias and ReLU are not counted.

    Args:
        batch: Rows of the input.
        widths: Layer widths, input first.
        repeats: Timed steps; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    dev = torch.device(device)
    layers: list[torch.nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers).to(dev)
    x = torch.randn(batch, widths[0], device=dev, requires_grad=True)  # [batch, widths[0]]

    def step() -> None:
        mlp(x).sum().backward()

    flops = sum(6 * batch * a * b for a, b in zip(widths[:-1], widths[1:], strict=True))
    return flops / _median_seconds(step, dev, repeats)


def measure_dense_layer_overhead(
    *, layers: int = 8, repeats: int = 5, device: str = "cpu"
) -> float:
    """Seconds per layer of a step of an MLP too small to compute anything (batch 4, width 4,
    Linear + ReLU layers): forward, backward and an SGD update — the dispatch cost a layer
    adds to every step, whatever its size.

    Args:
        layers: Linear layers of the MLP.
        repeats: Timed steps; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    return _mlp_step_seconds(4, (4,) * (layers + 1), repeats, device) / layers


def measure_activation_bandwidth(
    *,
    batch: int = FULL.activation_batch,
    widths: Sequence[int] = FULL.activation_widths,
    flops_per_s: float,
    layer_overhead_s: float,
    repeats: int = 5,
    device: str = "cpu",
) -> float | None:
    """Bytes/s of the activation traffic of an MLP step (forward, backward, SGD update), as
    the cost model counts it (per layer of i inputs and o outputs, batch·4·(3·i + 7·o) bytes):
    its time less its flops at `flops_per_s` and its layers at `layer_overhead_s`. A narrow,
    deep MLP on a large batch makes the traffic most of the time; None if nothing is left.

    Args:
        batch: Rows of the input.
        widths: Layer widths, input first.
        flops_per_s: `measure_dense_flops`'s rate.
        layer_overhead_s: `measure_dense_layer_overhead`'s cost.
        repeats: Timed steps; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    pairs = list(zip(widths[:-1], widths[1:], strict=True))
    seconds = _mlp_step_seconds(batch, widths, repeats, device)
    seconds -= sum(6 * batch * i * o for i, o in pairs) / flops_per_s
    seconds -= len(pairs) * layer_overhead_s
    elements = sum(ACTIVATION_IN_PASSES * i + ACTIVATION_OUT_PASSES * o for i, o in pairs)
    return batch * elements * 4 / seconds if seconds > 0 else None


def _mlp_step_seconds(batch: int, widths: Sequence[int], repeats: int, device: str) -> float:
    """Median seconds of an MLP step: forward, backward, SGD update."""
    dev = torch.device(device)
    layers: list[torch.nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers).to(dev)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=1e-6)
    x = torch.randn(batch, widths[0], device=dev)  # [batch, widths[0]]

    def step() -> None:
        optimizer.zero_grad()
        mlp(x).sum().backward()
        optimizer.step()

    return _median_seconds(step, dev, repeats)


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Fit `seconds = latency + nbytes / bandwidth`, minimizing the relative error (sizes span
    decades; a plain least-squares fit would let the largest message decide the latency).

    A non-positive intercept (noise) falls back to half the smallest time, a non-positive slope
    to the largest message's average rate, so both results are always > 0.

    Args:
        nbytes: Bytes a rank sends, per message size.
        seconds: Measured time per collective at each size.
    """
    x, t = np.asarray(nbytes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.size < 2 or (t <= 0).any():
        raise ValueError(f"need >= 2 (bytes, seconds > 0) pairs, got {list(x)}, {list(t)}")
    design = np.stack([1.0 / t, x / t], axis=1)  # [n, 2]: rows of (a + b x) / t = 1
    (latency, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if latency <= 0:
        latency = float(t.min()) / 2
    if per_byte <= 0:
        per_byte = float(t[x.argmax()] / x.max())
    return LinkFit(latency_s=float(latency), bw_bytes_per_s=float(1.0 / per_byte))


def _collective_seconds(
    op: Callable[[torch.Tensor, torch.Tensor], object], numel: int, repeats: int
) -> float:
    """Median seconds of `op(out, inp)` on this rank, after a warm-up and a barrier."""
    inp, out = torch.ones(numel), torch.empty(numel)  # [numel] float32 each
    op(out, inp)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        op(out, inp)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_collectives(sizes: Sequence[int] = FULL.message_bytes) -> dict[str, LinkFit]:
    """Fit gloo all-to-all and all-reduce on every rank of the current process group (>= 2
    ranks), one buffer size after another, each timed as the slowest rank's median.

    The bytes of each fit are those a rank sends: `(ranks - 1) / ranks` of its buffer for an
    all-to-all, twice that for a ring all-reduce (the NCCL-tests "bus bandwidth" convention).

    Args:
        sizes: Buffer bytes per rank, one measurement each.

    Returns:
        {'all_to_all': LinkFit, 'all_reduce': LinkFit}, the same on every rank.
    """
    world = dist.get_world_size()
    ops = {
        "all_to_all": lambda out, inp: dist.all_to_all_single(out, inp),
        "all_reduce": lambda out, inp: dist.all_reduce(inp),
    }
    share = (world - 1) / world
    sent = {"all_to_all": share, "all_reduce": 2 * share}
    fits = {}
    for name, op in ops.items():
        seconds = []
        for size in sizes:
            numel = max(world, size // 4 // world * world)  # all-to-all splits evenly
            repeats = max(3, min(30, (64 * _MIB) // size))
            slowest = torch.tensor([_collective_seconds(op, numel, repeats)])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds.append(float(slowest))
        fits[name] = fit_latency_bandwidth([s * sent[name] for s in sizes], seconds)
    return fits


def measure_sync_latency(
    *, burst_s: float = 2e-3, collectives: int = 6, repeats: int = 20
) -> float:
    """Seconds a small all-to-all costs between bursts of compute, on every rank of the
    current (gloo) process group: what a collective costs inside a training step, where each
    rank arrives from its own computation. On an idle machine this is about the network
    latency; on cores shared with other processes it also holds the time a rank waits for a
    peer that the OS had descheduled, which can be far more.

    Each rank alternates `burst_s` of matrix products and a 64-element all-to-all,
    `collectives` times per repetition, each repetition from a barrier; the cost is the
    median repetition's time less the same compute alone, per collective.

    Args:
        burst_s: compute between collectives (a few ms: the gap between a CPU step's
            collectives).
        collectives: collectives per repetition.
        repeats: timed repetitions.
    """
    a = torch.randn(128, 128)
    products = max(1, round(burst_s / _median_seconds(lambda: a @ a, torch.device("cpu"), 20)))
    inp, out = torch.ones(64), torch.empty(64)

    def repetition(talk: bool) -> None:
        for _ in range(collectives):
            for _ in range(products):
                a @ a
            if talk:
                dist.all_to_all_single(out, inp)

    seconds = {}
    for talk in (False, True):
        times = []
        for _ in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            repetition(talk)
            times.append(time.perf_counter() - t0)
        seconds[talk] = statistics.median(times[2:])
    cost = torch.tensor([max(0.0, seconds[True] - seconds[False]) / collectives])
    dist.all_reduce(cost, op=dist.ReduceOp.MAX)
    return float(cost)


def _init(rank: int, world: int, port: int, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def _mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (free pages where that file is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _compute(device: str, s: CalibrationSizes) -> dict[str, Any]:
    """This rank's compute measurements (`Measurements` fields)."""
    kw: dict[str, Any] = {"repeats": s.repeats, "device": device}
    out: dict[str, Any] = {"copy_bw_bytes_per_s": measure_copy_bandwidth(nbytes=s.copy_bytes, **kw)}
    lookup = measure_lookup_costs(
        rows=s.lookup_rows, dims=s.lookup_dims, bags=s.lookup_bags, pooling=s.lookup_pooling,
        alpha=s.lookup_alpha, **kw,
    )  # fmt: skip
    out |= {"lookup_rows_per_s": lookup.rows_per_s, "lookup_bytes_per_s": lookup.bytes_per_s}
    flops = measure_dense_flops(batch=s.mlp_batch, widths=s.mlp_widths, **kw)
    out |= {"dense_flops_per_s": flops, "dense_layer_overhead_s": 0.0}
    out["host_to_device_latency_s"] = measure_copy_latency(device=device)
    if device == "cuda":  # the stager's copies are DMA; the achieved flops cover the rest
        out["host_to_device_bw_bytes_per_s"] = measure_host_to_device_bandwidth(
            nbytes=s.copy_bytes, repeats=s.repeats
        )
        return out
    staging = measure_staging_costs(
        rows=s.lookup_rows, dim=s.lookup_dims[0], bags=s.lookup_bags[-1],
        pooling=s.lookup_pooling, alpha=s.lookup_alpha, capacities=s.staging_capacities, **kw,
    )  # fmt: skip
    # Lost in the noise: the copies alone (the scheduler's share unmeasured).
    out["host_to_device_bw_bytes_per_s"] = staging.bytes_per_s or out["copy_bw_bytes_per_s"]
    out["cache_scan_rows_per_s"] = staging.scan_rows_per_s
    layer = out["dense_layer_overhead_s"] = measure_dense_layer_overhead(**kw)
    out["dense_activation_bytes_per_s"] = measure_activation_bandwidth(
        batch=s.activation_batch, widths=s.activation_widths, flops_per_s=flops,
        layer_overhead_s=layer, **kw,
    )  # fmt: skip
    return out


def _calibration_worker(
    rank: int, world: int, port: int, device: str, sizes: CalibrationSizes, timeout_s: float,
    threads: int, out: str,
) -> None:  # fmt: skip
    """One rank of `calibrate`: compute (all ranks at once on CPU, rank 0 on CUDA), the
    collectives, then (CPU) the framework's costs on a one-rank process group of its own, all
    ranks again at once."""
    caller_threads = torch.get_num_threads()  # one rank runs in the caller's process
    torch.set_num_threads(threads)
    result: dict[str, Any] = {}
    try:
        _init(rank, world, port, timeout_s)
        try:
            dist.barrier()
            if device == "cpu" or rank == 0:
                result = _compute(device, sizes)
            dist.barrier()
            if world > 1:
                links = measure_collectives(sizes.message_bytes)
                result["links"] = {k: dataclasses.asdict(v) for k, v in links.items()}
                result["sync_latency_s"] = measure_sync_latency(repeats=4 * sizes.repeats)
        finally:
            dist.destroy_process_group()
        if device == "cpu":
            _init(0, 1, free_port(), timeout_s)  # this rank alone: TorchRec's plans name ranks
            try:
                options = MeasureOptions(
                    steps=sizes.framework_steps, warmup=sizes.framework_warmup, threads=threads
                )
                rates = topology_from(
                    _measurements(device, world, threads, [result], None), name="x"
                )
                costs = measure_framework_costs(
                    rates, big_rows=sizes.framework_rows, big_batch=sizes.framework_batch,
                    options=options,
                )  # fmt: skip
                result.update(dataclasses.asdict(costs))
            finally:
                dist.destroy_process_group()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        torch.set_num_threads(caller_threads)


def _measurements(
    device: str,
    ranks: int,
    threads: int,
    per_rank: list[dict[str, Any]],
    links: dict[str, LinkFit] | None,
    seconds: float = 0.0,
) -> Measurements:
    """The mean over ranks of each measured figure (None where a rank measured none)."""
    fields = {f.name for f in dataclasses.fields(Measurements)}

    def mean(name: str) -> Any:
        values = [r[name] for r in per_rank if r.get(name) is not None]
        return statistics.mean(values) if values else None

    measured = {name: mean(name) for name in per_rank[0] if name in fields}
    host_memory = _mem_available_bytes() // ranks
    device_memory = torch.cuda.mem_get_info()[0] if device == "cuda" else host_memory
    return Measurements(
        device=device,
        ranks=ranks,
        threads_per_rank=threads,
        all_to_all=(links or {}).get("all_to_all"),
        all_reduce=(links or {}).get("all_reduce"),
        device_memory_bytes=device_memory,
        host_memory_bytes=host_memory,
        seconds=seconds,
        **measured,
    )


def calibrate(
    *,
    ranks: int = 2,
    device: str = "cpu",
    sizes: CalibrationSizes = FULL,
    timeout_s: float = 300,
    threads: int | None = None,
) -> Measurements:
    """Measure this machine as seen by one of `ranks` ranks.

    On CPU every rank measures at once with `threads` threads (default `cpu_count // ranks`,
    its share when all ranks train at once); the figures are the means over ranks. Calibrate
    with the threads the jobs will train with: on shared cores more threads than free cores
    make OpenMP spin, and every rate collapses.

    Args:
        ranks: Ranks on this machine (1 measures no network: the CPU preset's figures stand in).
        device: 'cpu' or 'cuda'.
        sizes: Problem sizes (`FULL` or `QUICK`).
        timeout_s: Deadline of the whole calibration.
        threads: Torch threads per rank on CPU.
    """
    if device not in ("cpu", "cuda"):
        raise DistcacheConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if ranks < 1:
        raise DistcacheConfigError(f"ranks must be >= 1, got {ranks}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DistcacheConfigError("device 'cuda' asked for, but torch sees no CUDA device")
    start = time.perf_counter()
    if threads is not None and threads < 1:
        raise DistcacheConfigError(f"threads must be >= 1, got {threads}")
    threads = threads or max(1, (os.cpu_count() or 1) // ranks)
    threads = threads if device == "cpu" else torch.get_num_threads()
    with tempfile.TemporaryDirectory() as out:
        args = (device, sizes, timeout_s, threads, out)
        run_ranks(_calibration_worker, ranks, args, timeout_s=timeout_s)
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]
    links = {k: LinkFit(**v) for k, v in per_rank[0].get("links", {}).items()}
    return _measurements(device, ranks, threads, per_rank, links, time.perf_counter() - start)


def topology_from(m: Measurements, *, name: str) -> Topology:
    """The `Topology` of a calibrated machine.

    Device memory bandwidth is the copy's memory traffic (2x the bytes copied; on CUDA a
    device-to-device copy). The network figures are conservative: the lower bandwidth and the
    higher latency of all-to-all and all-reduce; the sync latency is what a collective costs
    between compute bursts (`measure_sync_latency`, contention included), at least that;
    without a network (one rank), the CPU preset's. Inter-node equals intra-node (one machine).
    """
    if m.all_to_all is not None and m.all_reduce is not None:
        bw = min(m.all_to_all.bw_bytes_per_s, m.all_reduce.bw_bytes_per_s)
        latency = max(m.all_to_all.latency_s, m.all_reduce.latency_s)
    else:
        cpu = preset("cpu", world_size=1)
        bw, latency = cpu.intra_node_bw_bytes_per_s, cpu.network_latency_s
    return Topology(
        name=name,
        world_size=m.ranks,
        ranks_per_node=m.ranks,
        compute_device=m.device,
        device_memory_bytes=int(m.device_memory_bytes),
        host_memory_bytes=int(m.host_memory_bytes),
        device_memory_bw_bytes_per_s=2 * m.copy_bw_bytes_per_s,
        host_to_device_bw_bytes_per_s=m.host_to_device_bw_bytes_per_s,
        host_to_device_latency_s=m.host_to_device_latency_s,
        intra_node_bw_bytes_per_s=bw,
        inter_node_bw_bytes_per_s=bw,
        network_latency_s=latency,
        dense_flops_per_s=m.dense_flops_per_s,
        lookup_rows_per_s=m.lookup_rows_per_s,
        lookup_bytes_per_s=m.lookup_bytes_per_s,
        cache_scan_rows_per_s=m.cache_scan_rows_per_s,
        dense_update_bytes_per_s=m.dense_update_bytes_per_s,
        dense_activation_bytes_per_s=m.dense_activation_bytes_per_s,
        dense_layer_overhead_s=m.dense_layer_overhead_s,
        step_overhead_s=m.step_overhead_s,
        sharding_overhead_s=m.sharding_overhead_s,
        id_overhead_s=m.id_overhead_s,
        sync_latency_s=None if m.sync_latency_s is None else max(latency, m.sync_latency_s),
    )


def _summary(m: Measurements) -> str:
    def si(v: float | None, unit: str) -> str:
        if v is None:
            return "-"
        exp = min(4, max(0, int(math.log10(max(v, 1.0)) // 3)))
        return f"{v / 10 ** (3 * exp):.3g} {' kMGT'[exp].strip()}{unit}"

    def link(name: str, fit: LinkFit | None) -> str:
        if fit is None:
            return f"  {name}: not measured (one rank)"
        return f"  {name}: latency {fit.latency_s * 1e6:.1f} us, {si(fit.bw_bytes_per_s, 'B/s')}"

    ms = "{:.3f} ms".format
    return "\n".join(
        [
            f"calibrated {m.device}, {m.ranks} ranks, {m.threads_per_rank} threads/rank, "
            f"{m.seconds:.1f} s",
            f"  memory copy        {si(m.copy_bw_bytes_per_s, 'B/s')}",
            f"  host -> device     {si(m.host_to_device_bw_bytes_per_s, 'B/s')}, "
            f"latency {m.host_to_device_latency_s * 1e6:.1f} us",
            f"  embedding lookup   {si(m.lookup_rows_per_s, 'rows/s')} + "
            f"{si(m.lookup_bytes_per_s, 'B/s')}",
            f"  dense compute      {si(m.dense_flops_per_s, 'FLOP/s')}, "
            f"{ms(1e3 * m.dense_layer_overhead_s)} per layer, activations "
            f"{si(m.dense_activation_bytes_per_s, 'B/s')}",
            f"  dense update (DP)  {si(m.dense_update_bytes_per_s, 'B/s')}",
            f"  framework          {ms(1e3 * m.step_overhead_s)} per step, "
            f"{ms(1e3 * m.sharding_overhead_s)} per sharding type, "
            f"{1e9 * m.id_overhead_s:.0f} ns per id routed",
            link("gloo all-to-all", m.all_to_all),
            link("gloo all-reduce", m.all_reduce),
            "  collective between compute bursts: "
            + ("-" if m.sync_latency_s is None else ms(1e3 * m.sync_latency_s)),
            f"  memory per rank    device {si(m.device_memory_bytes, 'B')}, "
            f"host {si(m.host_memory_bytes, 'B')}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m distcache calibrate`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m distcache calibrate", description="Measure this machine as a Topology."
    )
    parser.add_argument("--out", help="JSON file to write (default: stdout)")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (tests, smoke runs)")
    parser.add_argument("--name", help="topology name (default: calibrated-DEVICE-xRANKS)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline, s")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default cpus/ranks)")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        m = calibrate(
            ranks=args.ranks,
            device=args.device,
            sizes=QUICK if args.quick else FULL,
            timeout_s=args.timeout,
            threads=args.threads,
        )
    except DistcacheConfigError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    topology = topology_from(m, name=args.name or f"calibrated-{args.device}-x{args.ranks}")
    text = json.dumps(topology.to_dict(), indent=2) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    print(_summary(m), file=sys.stderr)
    return 0
