"""The network between local ranks, for `python -m distcache calibrate`: gloo all-to-all,
all-reduce, reduce-scatter and all-gather fitted as `time = latency + bytes / bandwidth` over
several message sizes (`measure_collectives`), and what a collective costs between compute
bursts, when peers compete for the cores (`measure_sync_latency`). Each runs on every rank of
the current process group.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from distcache.errors import DistcacheConfigError
from distcache.tools.microbench import FULL, MIB, median_seconds


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """A link modelled as `seconds = latency_s + bytes / bw_bytes_per_s` (bytes a rank sends)."""

    latency_s: float
    bw_bytes_per_s: float


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
        raise DistcacheConfigError(
            f"need >= 2 (bytes, seconds > 0) pairs, got {list(x)}, {list(t)}"
        )
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
    """Fit gloo all-to-all, all-reduce, reduce-scatter and all-gather on every rank of the
    current process group (>= 2 ranks), one buffer size after another, each timed as the
    slowest rank's median. The last two are what TorchRec's row-wise outputs take (their
    partial sums reduce-scattered forward, the gradients all-gathered backward).

    The bytes of each fit are those a rank sends: `(ranks - 1) / ranks` of its buffer for an
    all-to-all, a reduce-scatter (of its input) and an all-gather (of its output), twice that
    for a ring all-reduce (the NCCL-tests "bus bandwidth" convention).

    Args:
        sizes: Buffer bytes per rank, one measurement each.

    Returns:
        {'all_to_all', 'all_reduce', 'reduce_scatter', 'all_gather': LinkFit}, the same on
        every rank.
    """
    world = dist.get_world_size()
    ops = {
        "all_to_all": lambda out, inp: dist.all_to_all_single(out, inp),
        "all_reduce": lambda out, inp: dist.all_reduce(inp),
        "reduce_scatter": lambda out, inp: dist.reduce_scatter_tensor(
            out[: inp.numel() // world], inp
        ),
        "all_gather": lambda out, inp: dist.all_gather_into_tensor(
            out, inp[: out.numel() // world]
        ),
    }
    share = (world - 1) / world
    sent = {name: 2 * share if name == "all_reduce" else share for name in ops}
    fits = {}
    for name, op in ops.items():
        seconds = []
        for size in sizes:
            numel = max(world, size // 4 // world * world)  # all-to-all splits evenly
            repeats = max(3, min(30, (64 * MIB) // size))
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
    products = max(1, round(burst_s / median_seconds(lambda: a @ a, torch.device("cpu"), 20)))
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
