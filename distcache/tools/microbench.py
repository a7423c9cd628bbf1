"""The timed kernels of `python -m distcache calibrate`: what one rank's compute costs.

Each measurement is a small function returning one number (or one fit), so each can be tested
and re-used on its own (`distcache.tools.calibrate` describes them all and runs them):

- `measure_copy_bandwidth`, `measure_host_to_device_bandwidth`,
  `measure_device_to_host_bandwidth`, `measure_copy_latency`;
- `measure_lookup_costs`: a training step of distcache's cache kernel, fitted as
  `seconds = fixed + row accesses / rows_per_s + bytes / bytes_per_s`;
- `measure_staging_costs`: what a partial cache's misses add to a step;
- the dense part's (MLPs, DLRM's interaction): `distcache.tools.densebench`.

`CalibrationSizes` holds their problem sizes: `FULL` for a real calibration, `QUICK` for tests
(`CUDA_FULL`, `CUDA_QUICK` on a GPU; `sizes_for` picks them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from distcache.errors import DistcacheConfigError
from distcache.tools.devicetime import device_seconds

MIB = 1 << 20


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise DistcacheConfigError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class CalibrationSizes:
    """Problem sizes of the measurements; `FULL` for a real calibration, `QUICK` for tests."""

    copy_bytes: int = 256 * MIB
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
    schedule_rows: int = 500_000
    schedule_points: tuple[tuple[int, int], ...] = (
        (512, 1536), (512, 4096), (512, 32768), (2048, 32768), (4096, 7168), (4096, 65536),
    )  # fmt: skip
    """(ids per batch, cache slots) `schedbench.measure_schedule_costs` times the scheduler at:
    small caches scored whole and large ones swept (at least 4096 slots, more for big batches),
    so that ids and candidates do not move together."""
    mlp_batch: int = 2048
    mlp_widths: tuple[int, ...] = (512, 1024, 1024, 512, 256)
    """Layer widths, input first: an MLP of len - 1 linear layers."""
    activation_batch: int = 2048
    activation_widths: tuple[int, ...] = (8, 256, 8, 256, 8)
    """A narrow, deep MLP whose time is mostly activation traffic, its layers' outputs (2 MB)
    the size of a CPU DLRM's (B = 512-2048, widths 16-512). The rate depends on that size
    (here 11-14 GB/s up to 2 MB a layer, 4 at 16 MB, 2.7 at 32 MB: the caches), so one
    measured far larger overprices such MLPs 2-3.5 x."""
    interaction_batch: int = 2048
    interaction_shapes: tuple[tuple[int, int], ...] = (
        (5, 16), (9, 128), (17, 32), (27, 16), (27, 64),
    )  # fmt: skip
    """(F vectors, D dims) DLRM's interaction is timed at (>= 2 shapes, F >= 2). Its cost is
    an irregular function of the shape (the matmul library's kernel for each size): fitted at
    these five, the model came within +-25 % of 14 of 16 shapes of a grid F in 5-27, D in
    16-128 here (0.81-1.29 x)."""
    message_bytes: tuple[int, ...] = tuple(4096 << (2 * i) for i in range(8))  # 4 KiB .. 64 MiB
    repeats: int = 5
    """Timed repetitions of each compute measurement (the median is kept)."""
    framework_rows: int = 250_000
    """Rows of the data-parallel table whose dense update `measure_framework_costs` times:
    16 MB, a size replicated tables have (one that outgrows the last-level cache updates
    slower: here 1.6 GB/s at 16-32 MB, 1.0 GB/s at 64 MB)."""
    framework_batch: int = 8192
    """Batch of the run that times the framework's cost per id."""
    framework_steps: int = 30
    framework_warmup: int = 10

    def __post_init__(self) -> None:
        for name in ("copy_bytes", "lookup_rows", "lookup_pooling", "mlp_batch", "repeats"):
            _check_positive(name, getattr(self, name))
        for name in ("activation_batch", "framework_steps", "framework_rows", "framework_batch"):
            _check_positive(name, getattr(self, name))
        _check_positive("interaction_batch", self.interaction_batch)
        shapes = self.interaction_shapes
        if len(set(shapes)) < 2 or any(len(s) != 2 or s[0] < 2 or s[1] < 1 for s in shapes):
            raise DistcacheConfigError(
                "interaction_shapes must hold >= 2 distinct (F >= 2 vectors, D >= 1 dims) "
                f"pairs, got {shapes}"
            )
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
    copy_bytes=16 * MIB,
    lookup_rows=20_000,
    lookup_dims=(8, 32),
    lookup_bags=(64, 256),
    staging_capacities=(0.2, 0.4, 0.8),
    schedule_rows=20_000,
    schedule_points=((128, 512), (128, 8192), (1024, 3072), (1024, 12288)),
    mlp_batch=256,
    mlp_widths=(128, 256, 128),
    activation_batch=512,
    activation_widths=(8, 256, 8),
    interaction_batch=256,
    interaction_shapes=((3, 8), (3, 32), (9, 8)),
    message_bytes=(1024, 16 * 1024, 256 * 1024),
    repeats=3,
    framework_rows=50_000,
    framework_batch=1024,
    framework_steps=6,
    framework_warmup=2,
)


# On a GPU the sizes above leave the device idle between launches: its lookups, scheduler,
# MLPs and interaction are timed at batches large enough that the device's work, not the
# launches, sets the time and its growth with the batch (the launches are priced apart, per
# layer and per step), the caches sized to hold two such batches' rows.
CUDA_FULL = dataclasses.replace(
    FULL,
    lookup_rows=2_000_000,
    lookup_bags=(2048, 16384),
    staging_capacities=(0.05, 0.1, 0.2),
    schedule_rows=2_000_000,
    schedule_points=(
        (4096, 12288), (4096, 32768), (4096, 262144), (16384, 262144), (32768, 57344),
        (32768, 524288),
    ),
    mlp_batch=16384,
    activation_batch=65536,
    interaction_batch=65536,
)  # fmt: skip
CUDA_QUICK = dataclasses.replace(
    QUICK,
    lookup_rows=500_000,
    lookup_dims=FULL.lookup_dims,
    lookup_bags=(1024, 8192),
    staging_capacities=(0.1, 0.2, 0.4),
    schedule_rows=CUDA_FULL.schedule_rows,
    schedule_points=((4096, 12288), (4096, 262144), (32768, 57344), (32768, 524288)),
    mlp_batch=16384,
    mlp_widths=FULL.mlp_widths,
    activation_batch=65536,
    interaction_batch=65536,
    interaction_shapes=FULL.interaction_shapes,
)


def sizes_for(device: str, *, quick: bool) -> CalibrationSizes:
    """The problem sizes of a calibration on `device` ('cpu' or 'cuda'): quick or full."""
    if device == "cuda":
        return CUDA_QUICK if quick else CUDA_FULL
    return QUICK if quick else FULL


@dataclass(frozen=True, kw_only=True)
class LookupCosts:
    """A lookup kernel's step: `fixed_s + accesses / rows_per_s + bytes / bytes_per_s`."""

    rows_per_s: float
    bytes_per_s: float | None
    """None where the widths measured did not tell bytes from rows (noise)."""
    fixed_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
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
    return src.numel() * 4 / median_seconds(lambda: dst.copy_(src), dev, repeats)


def measure_host_to_device_bandwidth(*, nbytes: int = FULL.copy_bytes, repeats: int = 5) -> float:
    """Bytes/s of a copy from pinned host memory to the current CUDA device.

    Args:
        nbytes: Size of the copied tensor.
        repeats: Timed copies; the median is kept.
    """
    return _pinned_copy_bandwidth(nbytes, repeats, to_device=True)


def measure_device_to_host_bandwidth(*, nbytes: int = FULL.copy_bytes, repeats: int = 5) -> float:
    """Bytes/s of a copy from the current CUDA device to pinned host memory: the direction of
    a cache's write-backs.

    Args:
        nbytes: Size of the copied tensor.
        repeats: Timed copies; the median is kept.
    """
    return _pinned_copy_bandwidth(nbytes, repeats, to_device=False)


def _pinned_copy_bandwidth(nbytes: int, repeats: int, *, to_device: bool) -> float:
    """Bytes/s of an asynchronous copy between pinned host memory and the CUDA device."""
    dev = torch.device("cuda")
    host = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
    device = torch.empty(host.shape, dtype=host.dtype, device=dev)
    src, dst = (host, device) if to_device else (device, host)
    seconds = median_seconds(lambda: dst.copy_(src, non_blocking=True), dev, repeats)
    return host.numel() * 4 / seconds


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
    return median_seconds(lambda: dst.copy_(src, non_blocking=True), dev, repeats)


def power_law_batches(
    rows: int, alpha: float, bags: int, pooling: int, count: int, seed: int, dev: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`count` batches of `bags` bags of `pooling` power-law ids each (`[bags * pooling]` on
    `dev`), and their offsets `[bags + 1]`."""
    from distcache.data.traces import zipf_trace

    n = bags * pooling
    trace = zipf_trace(rows=rows, alpha=alpha, batch=n, batches=count, seed=seed)
    return [ids.to(dev) for ids in trace], torch.arange(0, n + 1, pooling, device=dev)


def _mean_distinct(batches: list[torch.Tensor]) -> float:
    """Mean distinct ids of a batch."""
    return statistics.mean(int(b.unique().numel()) for b in batches)


def _lookup_step(
    *, rows: int, dim: int, bags: int, pooling: int, alpha: float, repeats: int, device: str
) -> tuple[float, float]:
    """(median seconds, mean distinct rows) of a training step of distcache's cache kernel on
    one table with every row resident: the next batch enters the look-ahead window and is
    staged, the batch is looked up (sum-pooled) and its rows updated (SGD) in backward. On a
    GPU the device's work (`device_seconds`: the host's launches and the graphs' capture
    excluded), on CPU the wall clock."""
    from distcache.cache.config import CacheConfig
    from distcache.cache.module import CachedEmbeddingBags, TableSpec

    dev = torch.device(device)
    config = CacheConfig(capacity=1.0, lookahead=1, prefetch_depth=1, check_ids=False)
    table = TableSpec(name="t", num_embeddings=rows, embedding_dim=dim)
    kernel = CachedEmbeddingBags([table], config, device=dev)
    every, whole = torch.arange(rows, device=dev), torch.tensor([0, rows], device=dev)
    kernel.enqueue(every, whole)  # load every row: the steps below only look up and update
    kernel(every, whole).sum().backward()
    batches, offsets = power_law_batches(rows, alpha, bags, pooling, repeats + 3, dim, dev)
    kernel.enqueue(batches[0], offsets)
    window = deque([batches[0]])  # enqueued, not yet looked up
    step = itertools.count(1)

    def train() -> None:  # (the batches cycle: every row is resident)
        window.append(batches[next(step) % len(batches)])
        kernel.enqueue(window[-1], offsets)
        kernel.prefetch()
        kernel(window.popleft(), offsets).sum().backward()

    return device_seconds(train, dev, repeats), _mean_distinct(batches)


def _fused_lookup_step(
    *, rows: int, dim: int, bags: int, pooling: int, alpha: float, repeats: int, device: str
) -> tuple[float, float]:
    """As `_lookup_step`, for TorchRec's fused kernel (FBGEMM's table-batched embedding, SGD
    in backward), which serves device-stored tables."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    dev = torch.device(device)
    where = (
        (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
        if dev.type == "cuda"
        else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    )
    kernel = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, *where)], optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01, device=dev
    )
    batches, offsets = power_law_batches(rows, alpha, bags, pooling, repeats + 3, dim, dev)
    step = itertools.count()

    def train() -> None:
        kernel(batches[next(step) % len(batches)], offsets).sum().backward()

    return device_seconds(train, dev, repeats), _mean_distinct(batches)


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

    dev = torch.device(device)
    config = CacheConfig(capacity=capacity, lookahead=lookahead, prefetch_depth=1, check_ids=False)
    table = TableSpec(name="t", num_embeddings=rows, embedding_dim=dim)
    kernel = CachedEmbeddingBags([table], config, device=dev)
    if capacity >= 1.0:
        engine = kernel.engines[0]
        engine.enqueue(torch.arange(rows, device=dev))
        engine.release(engine.lookup_plan())
    warm, steps = 8 * repeats, 4 * repeats
    count = warm + steps + lookahead
    batches, offsets = power_law_batches(rows, alpha, bags, pooling, count, 1, dev)
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
    kernel: str = "distcache",
) -> LookupCosts:
    """A training step of distcache's cache kernel on one table with every row resident (the
    next batch enters the look-ahead window, the batch is looked up and its rows updated by
    SGD in backward), or of TorchRec's fused kernel (`kernel="fused"`: FBGEMM's, which serves
    device-stored tables), timed at every (dim, bags) (on a GPU the device's work alone:
    `devicetime.device_seconds`) and fitted by least relative squares as
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
        kernel: "distcache" or "fused".
    """
    if kernel not in ("distcache", "fused"):
        raise DistcacheConfigError(f"kernel must be 'distcache' or 'fused', got {kernel!r}")
    step = _fused_lookup_step if kernel == "fused" else _lookup_step
    points = []  # (seconds, accesses, bytes)
    for dim in dims:
        for b in bags:
            seconds, unique = step(
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
