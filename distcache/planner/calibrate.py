"""`python -m distcache calibrate`: measure this machine and write a `Topology` JSON.

Each measurement is a small function returning one number (or one fitted link), so each can be
tested and re-used on its own:

- `measure_copy_bandwidth`: bytes/s of a large tensor copy on the compute device.
- `measure_host_to_device_bandwidth`: bytes/s from pinned host memory to the GPU (CUDA only).
- `measure_lookup_rate`: embedding-bag rows/s, forward plus a row-wise SGD update of every row
  looked up (what a training step does per id).
- `measure_dense_flops`: achieved FLOP/s of an MLP forward + backward.
- `measure_collectives`: gloo all-to-all and all-reduce between `ranks` local processes, fitted
  as `time = latency + bytes / bandwidth` over several message sizes.

`calibrate` runs them all and `topology_from` turns the results into a `Topology`. On CPU the
"device" is host memory: device memory bandwidth and host-to-device bandwidth come from the same
copy, and device and host memory are the same pool (each is MemAvailable / ranks; a planner must
not fill both). On one machine the inter-node figures equal the intra-node ones. The network is
measured with gloo over host tensors on CUDA machines too (an NCCL measurement needs one GPU per
rank).

Example::

    python -m distcache calibrate --ranks 2 --out topology.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from distcache.errors import DistcacheConfigError
from distcache.planner.types import Topology

__all__ = [
    "CalibrationSizes",
    "LinkFit",
    "Measurements",
    "calibrate",
    "fit_latency_bandwidth",
    "main",
    "measure_collectives",
    "measure_copy_bandwidth",
    "measure_dense_flops",
    "measure_copy_latency",
    "measure_host_to_device_bandwidth",
    "measure_lookup_rate",
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
    lookup_rows: int = 1_000_000
    lookup_dim: int = 64
    lookup_bags: int = 8192
    lookup_pooling: int = 8
    """Ids per bag; a step looks up lookup_bags * lookup_pooling rows."""
    mlp_batch: int = 2048
    mlp_widths: tuple[int, ...] = (512, 1024, 1024, 512, 256)
    """Layer widths, input first: an MLP of len - 1 linear layers."""
    message_bytes: tuple[int, ...] = tuple(4096 << (2 * i) for i in range(8))  # 4 KiB .. 64 MiB
    repeats: int = 5
    """Timed repetitions of each compute measurement (the median is kept)."""

    def __post_init__(self) -> None:
        for name in ("copy_bytes", "lookup_rows", "lookup_dim", "lookup_bags", "lookup_pooling"):
            _check_positive(name, getattr(self, name))
        _check_positive("mlp_batch", self.mlp_batch)
        _check_positive("repeats", self.repeats)
        if len(self.mlp_widths) < 2 or min(self.mlp_widths) < 1:
            raise DistcacheConfigError(
                f"mlp_widths must hold >= 2 widths, each >= 1, got {self.mlp_widths}"
            )
        if len(self.message_bytes) < 2 or min(self.message_bytes) < 64:
            raise DistcacheConfigError(
                f"message_bytes must hold >= 2 sizes, each >= 64, got {self.message_bytes}"
            )


FULL = CalibrationSizes()
QUICK = CalibrationSizes(
    copy_bytes=16 * _MIB,
    lookup_rows=100_000,
    lookup_dim=32,
    lookup_bags=1024,
    lookup_pooling=4,
    mlp_batch=256,
    mlp_widths=(128, 256, 128),
    message_bytes=(1024, 16 * 1024, 256 * 1024),
    repeats=3,
)


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """A link modelled as `seconds = latency_s + bytes / bw_bytes_per_s` (bytes a rank sends)."""

    latency_s: float
    bw_bytes_per_s: float


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Raw results of `calibrate`, per rank."""

    device: str
    ranks: int
    threads_per_rank: int
    copy_bw_bytes_per_s: float
    host_to_device_bw_bytes_per_s: float
    host_to_device_latency_s: float
    lookup_rows_per_s: float
    dense_flops_per_s: float
    all_to_all: LinkFit
    all_reduce: LinkFit
    device_memory_bytes: int
    host_memory_bytes: int
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


def measure_lookup_rate(
    *,
    rows: int = FULL.lookup_rows,
    dim: int = FULL.lookup_dim,
    bags: int = FULL.lookup_bags,
    pooling: int = FULL.lookup_pooling,
    repeats: int = 5,
    device: str = "cpu",
    seed: int = 0,
) -> float:
    """Embedding-bag rows/s for a training step: a sum-pooled forward over uniform random ids,
    then a row-wise SGD update of every row looked up (gather the bag's gradient, index_add it).

    Uniform ids are the pessimistic case (no reuse in the CPU cache); skewed real traffic runs
    somewhat faster.

    Args:
        rows: Table rows; `rows * dim * 4` bytes are allocated.
        dim: Embedding dimension.
        bags: Bags per step.
        pooling: Ids per bag.
        repeats: Timed steps; the median is kept.
        device: 'cpu' or 'cuda'.
        seed: Seed of the random ids.
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, dim, generator=gen).to(dev)  # [rows, dim]
    ids = torch.randint(rows, (bags * pooling,), generator=gen).to(dev)  # [bags * pooling]
    offsets = torch.arange(0, bags * pooling, pooling, device=dev)  # [bags]
    bag_of_id = torch.arange(bags, device=dev).repeat_interleave(pooling)  # [bags * pooling]
    grad = torch.full((bags, dim), 1e-6, device=dev)  # [bags, dim]: stands in for dL/dbag

    def step() -> None:
        F.embedding_bag(ids, weight, offsets, mode="sum")
        weight.index_add_(0, ids, grad.index_select(0, bag_of_id), alpha=-0.01)

    return ids.numel() / _median_seconds(step, dev, repeats)


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _collective_worker(
    rank: int, world: int, port: int, sizes: tuple[int, ...], timeout_s: float, results: object
) -> None:
    """One rank of `measure_collectives`: rank 0 reports the slowest rank's time per size."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    ops = {
        "all_to_all": lambda out, inp: dist.all_to_all_single(out, inp),
        "all_reduce": lambda out, inp: dist.all_reduce(inp),
    }
    try:
        report: dict[str, list[float]] = {}
        for name, op in ops.items():
            for size in sizes:
                numel = max(world, size // 4 // world * world)  # all-to-all splits evenly
                repeats = max(3, min(30, (64 * _MIB) // size))
                seconds = torch.tensor([_collective_seconds(op, numel, repeats)])
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                report.setdefault(name, []).append(float(seconds))
        if rank == 0:
            results.put(report)  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def measure_collectives(
    *, ranks: int = 2, sizes: Sequence[int] = FULL.message_bytes, timeout_s: float = 120.0
) -> dict[str, LinkFit]:
    """Fit gloo all-to-all and all-reduce between `ranks` processes on this machine.

    The bytes of each fit are those a rank sends: `(ranks - 1) / ranks` of its buffer for an
    all-to-all, twice that for a ring all-reduce (the NCCL-tests "bus bandwidth" convention).
    Ranks are spawned on a free local port; a rank that dies or a run that passes `timeout_s`
    raises instead of hanging.

    Args:
        ranks: Processes (>= 2).
        sizes: Buffer bytes per rank, one measurement each.
        timeout_s: Deadline of the whole measurement, also the process-group timeout.

    Returns:
        {'all_to_all': LinkFit, 'all_reduce': LinkFit}.
    """
    if ranks < 2:
        raise DistcacheConfigError(f"ranks must be >= 2 to measure collectives, got {ranks}")
    results = mp.get_context("spawn").SimpleQueue()
    args = (ranks, _free_port(), tuple(sizes), timeout_s, results)
    context = mp.start_processes(_collective_worker, args, nprocs=ranks, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.5, grace_period=2.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gloo calibration did not finish within {timeout_s} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()
    if results.empty():
        raise RuntimeError("gloo calibration: rank 0 exited without a report")
    report = results.get()
    share = (ranks - 1) / ranks
    sent = {"all_to_all": share, "all_reduce": 2 * share}
    return {
        name: fit_latency_bandwidth([s * sent[name] for s in sizes], report[name]) for name in sent
    }


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


def calibrate(
    *, ranks: int = 2, device: str = "cpu", sizes: CalibrationSizes = FULL, timeout_s: float = 300
) -> Measurements:
    """Measure this machine as seen by one of `ranks` ranks.

    On CPU the compute measurements run with `cpu_count // ranks` threads, each rank's share
    when all ranks train at once (the contention of a shared memory bus is not modelled).

    Args:
        ranks: Ranks on this machine (>= 2, for the collectives).
        device: 'cpu' or 'cuda'.
        sizes: Problem sizes (`FULL` or `QUICK`).
        timeout_s: Deadline of the collective measurement.
    """
    if device not in ("cpu", "cuda"):
        raise DistcacheConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if ranks < 2:
        raise DistcacheConfigError(f"ranks must be >= 2 to measure collectives, got {ranks}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DistcacheConfigError("device 'cuda' asked for, but torch sees no CUDA device")
    start = time.perf_counter()
    threads = torch.get_num_threads()
    share = max(1, (os.cpu_count() or 1) // ranks) if device == "cpu" else threads
    torch.set_num_threads(share)
    try:
        s, kw = sizes, {"repeats": sizes.repeats, "device": device}
        copy_bw = measure_copy_bandwidth(nbytes=s.copy_bytes, **kw)
        lookup = measure_lookup_rate(
            rows=s.lookup_rows, dim=s.lookup_dim, bags=s.lookup_bags, pooling=s.lookup_pooling, **kw
        )
        flops = measure_dense_flops(batch=s.mlp_batch, widths=s.mlp_widths, **kw)
        h2d_latency = measure_copy_latency(device=device)
        if device == "cuda":
            h2d = measure_host_to_device_bandwidth(nbytes=s.copy_bytes, repeats=s.repeats)
            device_memory = torch.cuda.mem_get_info()[0]
        else:
            h2d = copy_bw
    finally:
        torch.set_num_threads(threads)
    links = measure_collectives(ranks=ranks, sizes=s.message_bytes, timeout_s=timeout_s)
    host_memory = _mem_available_bytes() // ranks
    return Measurements(
        device=device,
        ranks=ranks,
        threads_per_rank=share,
        copy_bw_bytes_per_s=copy_bw,
        host_to_device_bw_bytes_per_s=h2d,
        host_to_device_latency_s=h2d_latency,
        lookup_rows_per_s=lookup,
        dense_flops_per_s=flops,
        all_to_all=links["all_to_all"],
        all_reduce=links["all_reduce"],
        device_memory_bytes=device_memory if device == "cuda" else host_memory,
        host_memory_bytes=host_memory,
        seconds=time.perf_counter() - start,
    )


def topology_from(m: Measurements, *, name: str) -> Topology:
    """The `Topology` of a calibrated machine.

    Device memory bandwidth is the copy's memory traffic (2x the bytes copied; on CUDA a
    device-to-device copy). The network figures are conservative: the lower bandwidth and the
    higher latency of all-to-all and all-reduce. Inter-node equals intra-node (one machine).
    """
    bw = min(m.all_to_all.bw_bytes_per_s, m.all_reduce.bw_bytes_per_s)
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
        network_latency_s=max(m.all_to_all.latency_s, m.all_reduce.latency_s),
        dense_flops_per_s=m.dense_flops_per_s,
        lookup_rows_per_s=m.lookup_rows_per_s,
    )


def _summary(m: Measurements) -> str:
    def si(v: float, unit: str) -> str:
        exp = min(4, max(0, int(math.log10(max(v, 1.0)) // 3)))
        return f"{v / 10 ** (3 * exp):.3g} {' kMGT'[exp].strip()}{unit}"

    link = "{}: latency {:.1f} us, {}".format
    return "\n".join(
        [
            f"calibrated {m.device}, {m.ranks} ranks, {m.threads_per_rank} threads/rank, "
            f"{m.seconds:.1f} s",
            f"  memory copy        {si(m.copy_bw_bytes_per_s, 'B/s')}",
            f"  host -> device     {si(m.host_to_device_bw_bytes_per_s, 'B/s')}, "
            f"latency {m.host_to_device_latency_s * 1e6:.1f} us",
            f"  embedding lookup   {si(m.lookup_rows_per_s, 'rows/s')}",
            f"  dense compute      {si(m.dense_flops_per_s, 'FLOP/s')}",
            "  " + link("gloo all-to-all", m.all_to_all.latency_s * 1e6,
                        si(m.all_to_all.bw_bytes_per_s, "B/s")),
            "  " + link("gloo all-reduce", m.all_reduce.latency_s * 1e6,
                        si(m.all_reduce.bw_bytes_per_s, "B/s")),
            f"  memory per rank    device {si(m.device_memory_bytes, 'B')}, "
            f"host {si(m.host_memory_bytes, 'B')}",
        ]
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m distcache calibrate`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m distcache calibrate", description="Measure this machine as a Topology."
    )
    parser.add_argument("--out", help="JSON file to write (default: stdout)")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (>= 2; default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (tests, smoke runs)")
    parser.add_argument("--name", help="topology name (default: calibrated-DEVICE-xRANKS)")
    parser.add_argument("--timeout", type=float, default=300.0, help="collectives deadline, s")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        m = calibrate(
            ranks=args.ranks,
            device=args.device,
            sizes=QUICK if args.quick else FULL,
            timeout_s=args.timeout,
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
