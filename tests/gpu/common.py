"""Shared by the CUDA tests: device-aware helpers around `tests/unit/cache/reference.py`.

Each test module names its device in a module constant `DEVICE` (CUDA, skipped without one);
the helpers take the device as an argument, so a test module's logic can be checked on a CPU
machine by running a copy of it with `DEVICE = torch.device("cpu")`.
"""

from __future__ import annotations

import torch

from distcache import CachedEmbeddingBags
from tests.unit.cache.reference import Batch, loss_of

CUDA_REASON = "needs a CUDA device (the cache's device path: side stream, pinned memory, events)"


def to_device(batch: Batch, device: torch.device) -> Batch:
    values, offsets = batch
    return values.to(device), offsets.to(device)


def train_windowed(
    cached: CachedEmbeddingBags,
    batches: list[Batch],
    *,
    lookahead: int,
    stage_while_training: bool = True,
) -> list[torch.Tensor]:
    """Train `cached` on `batches` as the look-ahead pipeline does: batches up to t + L enqueued,
    rows staged K ahead before the lookup and again while batch t trains; returns the outputs
    (on the CPU)."""
    device = cached.device
    outs = []
    enqueued = 0
    for t, batch in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + lookahead:
            cached.enqueue(*to_device(batches[enqueued], device))
            enqueued += 1
        cached.prefetch()
        out = cached(*to_device(batch, device))
        if stage_while_training:
            cached.prefetch()
        loss_of(out).backward()
        outs.append(out.detach().cpu())
    return outs


def train_without_syncs(
    cached: CachedEmbeddingBags, batches: list[Batch], *, lookahead: int, warm: int
) -> None:
    """Train `cached` as the pipeline does (L ahead, K staged before each lookup), from step
    `warm` on (graphs captured, caches full) under `set_sync_debug_mode("error")`: any
    synchronization raises. Every engine's queued calls are waited for before that step and at
    the end (a scheduler thread's error is raised there)."""
    device = cached.device
    enqueued = 0
    try:
        for t, batch in enumerate(batches):
            if t == warm:
                for engine in cached.engines:
                    engine._lane.join()
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("error")
            while enqueued < len(batches) and enqueued <= t + lookahead:
                cached.enqueue(*to_device(batches[enqueued], device))
                enqueued += 1
            cached.prefetch()
            loss_of(cached(*to_device(batch, device))).backward()
        for engine in cached.engines:
            engine._lane.join()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def counters(cached: CachedEmbeddingBags) -> dict[str, dict[str, float]]:
    """Each engine's counters, without the host timings (which differ run to run) and the graph
    counters (`cuda_graphs` is on by default for CUDA only)."""
    skip = ("staging_s", "wait_s", "graph_captures", "graph_replays")
    return {
        name: {k: v for k, v in s.as_dict().items() if k not in skip}
        for name, s in cached.stats().items()
    }
