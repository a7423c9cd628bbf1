"""Staging overlaps training on CUDA, and the host runs ahead of the device.

- Plans are made on the cache's schedule stream and rows move on its staging stream; a lookup
  makes the compute stream wait for its plan's ready event on the device.
- The training thread never waits for the device: not in `enqueue`, `prefetch`, the lookup or
  backward. Only the stager's worker thread waits (for a plan's counts), by design.
- `torch.cuda.set_sync_debug_mode("error")` turns any synchronizing copy or stream sync in the
  per-batch path (any thread) into an error.
- Run-ahead: with the compute stream busy for 0.3 s, K training steps return to the host long
  before it is free (the stager needs a plan's counts, so the host runs up to K batches ahead).

`test_host_sync_sites` measures what remains (writes it to $DISTCACHE_SYNC_REPORT if set).
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import distcache
from distcache import CacheConfig, CachedEmbeddingBags
from tests.gpu.common import CUDA_REASON, to_device
from tests.unit.cache.reference import loss_of, make_batches, make_tables

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)

TABLES = make_tables([16], [4000])
LOOKAHEAD = 8


def _bags(
    capacity: int, *, depth: int = 1, staging: str = "worker", graphs: bool | None = None
) -> CachedEmbeddingBags:
    config = CacheConfig(
        capacity=capacity,
        lookahead=LOOKAHEAD,
        prefetch_depth=depth,
        learning_rate=1.0,
        staging=staging,
        cuda_graphs=graphs,  # None: on for CUDA
    )
    return CachedEmbeddingBags(TABLES, config, device=DEVICE)


def _batches(num: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches already on the device, as the pipeline hands them to the caches."""
    batches = make_batches(TABLES, batch_size=64, num_batches=num, max_len=4, seed=seed)
    return [to_device(b, DEVICE) for b in batches]


class _Window:
    """Drives a cache as the pipeline does: enqueue up to t + L, stage K ahead, train."""

    def __init__(self, bags: CachedEmbeddingBags, batches: list):
        self.bags, self.batches, self.enqueued, self.t = bags, batches, 0, 0

    def enqueue(self) -> None:
        while self.enqueued < len(self.batches) and self.enqueued <= self.t + LOOKAHEAD:
            self.bags.enqueue(*self.batches[self.enqueued])
            self.enqueued += 1

    def step(self) -> torch.Tensor:
        self.enqueue()
        self.bags.prefetch()
        out = self.bags(*self.batches[self.t])
        self.bags.prefetch()
        loss_of(out).backward()
        self.t += 1
        return out


@pytest.mark.parametrize("graphs", [None, False])
@pytest.mark.parametrize("staging", ["worker", "direct"])
def test_lookups_wait_on_the_staging_event_and_the_training_thread_never_waits(
    monkeypatch, staging, graphs
):
    """Direct staging reads a plan's counts at its lookup, from a copy queued K batches before:
    the training thread may call `Event.synchronize` on it, but must find it complete."""
    bags = _bags(capacity=400, staging=staging, graphs=graphs)
    (engine,) = bags.engines
    streams = engine.streams
    compute = torch.cuda.current_stream(DEVICE)
    for stream in (streams.schedule, streams.staging):
        assert isinstance(stream, torch.cuda.Stream) and stream != compute

    main = threading.get_ident()
    waits: list[tuple[int, object]] = []
    host_waits: list[str] = []
    real_wait_event = torch.cuda.Stream.wait_event
    real = {
        "Stream.synchronize": torch.cuda.Stream.synchronize,
        "Event.synchronize": torch.cuda.Event.synchronize,
    }

    def wait_event(self, event):
        waits.append((self.cuda_stream, event))
        real_wait_event(self, event)

    def spy(name):
        def call(self):
            done = staging == "direct" and name == "Event.synchronize" and self.query()
            if threading.get_ident() == main and not done:
                host_waits.append(name)
            real[name](self)

        return call

    def device_sync(device=None):
        host_waits.append("torch.cuda.synchronize")

    monkeypatch.setattr(torch.cuda.Stream, "wait_event", wait_event)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", spy("Stream.synchronize"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", spy("Event.synchronize"))
    monkeypatch.setattr(torch.cuda, "synchronize", device_sync)

    window = _Window(bags, _batches(16))
    for _ in range(16):
        window.enqueue()
        bags.prefetch()
        plan = engine._ahead[0]  # staged ahead of its lookup
        job, future = engine.stager._jobs[plan.seq]
        if future is not None:
            future.result()  # (the test waits for the worker, to see its ready event)
        else:
            real["Event.synchronize"](job.mirrored)  # (the test lets the plan's counts arrive)
        waits.clear()
        out = bags(*window.batches[window.t])  # the lookup
        assert [e for s, e in waits if s == compute.cuda_stream] == [job.ready], (
            "the lookup must make the compute stream wait on the plan's ready event"
        )
        bags.prefetch()
        loss_of(out).backward()
        window.t += 1
    # Only a CUDA graph's capture (`cuda_graphs`, on by default) synchronizes: once per shape.
    captures = bags._router.graphs.captures + engine.scheduler.graphs.captures
    assert host_waits == ["torch.cuda.synchronize"] * captures, (
        f"the training thread waited for the device: {host_waits} ({captures} captures)"
    )
    stats = engine.stats()
    assert stats.loads > 0 and stats.writebacks > 0 and stats.critical_misses == 0


def _cycles_for(seconds: float) -> int:
    """GPU spin cycles (`torch.cuda._sleep`) that keep the current stream busy for `seconds`."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch build")
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1000 / max(start.elapsed_time(end), 1e-3))


@pytest.mark.parametrize("staging", ["worker", "direct"])
def test_the_host_runs_k_training_steps_ahead_of_a_busy_device(staging):
    """5 steps (enqueue, stage, forward, backward) with K = 6 return while the compute stream
    is still busy for 0.3 s: nothing in them waited for the device."""
    busy_s, steps = 0.3, 5
    cycles = _cycles_for(busy_s)
    bags = _bags(capacity=600, depth=6, staging=staging)
    # 16 batches in turn (more rows than the cache: it evicts), twice before the timed steps:
    # a graph is captured the second time its shape comes, and a capture synchronizes.
    window = _Window(bags, _batches(16) * 4)
    for _ in range(36):
        window.step()
    graphs = (bags._router.graphs, bags.engines[0].scheduler.graphs)
    captures = [g.captures for g in graphs]
    window.enqueue()
    bags.prefetch()
    for _job, future in bags.engines[0].stager._jobs.values():
        if future is not None:
            future.result()  # the K plans ahead are staged
    torch.cuda.synchronize(DEVICE)
    torch.cuda._sleep(cycles)  # the device is busy
    start = time.perf_counter()
    for _ in range(steps):
        window.step()
    host_s = time.perf_counter() - start
    torch.cuda.synchronize(DEVICE)
    assert [g.captures for g in graphs] == captures, "a graph was captured in the timed steps"
    assert bags.engines[0].stats().evictions > 0
    assert host_s < busy_s / 3, (
        f"{steps} steps took {host_s:.3f} s on the host while the device was busy for "
        f"{busy_s} s: they waited for it"
    )


@pytest.mark.parametrize("graphs", [None, False])
@pytest.mark.parametrize("staging", ["worker", "direct"])
def test_per_batch_path_has_no_synchronizing_call(staging, graphs, monkeypatch):
    """enqueue, prefetch, forward and backward under `set_sync_debug_mode("error")`, which does
    not see an event's `synchronize`: those are counted apart, on every thread but the
    stager's worker (the training thread, autograd's). With the worker thread none waits for
    an event; with direct staging the training thread reads each plan's counts after an event
    recorded K batches before, which must have completed by then."""
    bags = _bags(capacity=300, depth=2, staging=staging, graphs=graphs)
    window = _Window(bags, _batches(24))
    for _ in range(8):  # warm up: the cache fills, evictions and write-backs begin
        window.step()
    torch.cuda.synchronize(DEVICE)
    waits, blocked = [], []
    synchronize = torch.cuda.Event.synchronize

    def counted(event: torch.cuda.Event) -> None:
        if not threading.current_thread().name.startswith("distcache-stager"):
            waits.append(_innermost_distcache_frame(traceback.extract_stack()))
            if not event.query():
                blocked.append(waits[-1])
        synchronize(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            window.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bags.engines[0].stats().writebacks > 0
    assert not blocked, f"the training thread waited for the device at {Counter(blocked)}"
    if staging == "worker":
        assert not waits, f"the training thread waited for events at {Counter(waits)}"


def _innermost_distcache_frame(stack: list[traceback.FrameSummary]) -> str:
    root = Path(distcache.__file__).resolve().parent
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if root in path.parents:
            where = f"{path.relative_to(root)}:{frame.lineno} {frame.name}"
            return f"{where}: {(frame.line or '').strip()}"
    return "outside distcache: " + " <- ".join(
        f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack[-6:-1])
    )


def test_host_sync_sites():
    """Measures where the per-batch path synchronizes (sync debug mode "warn", each warning's
    innermost distcache frame); fails listing them if there are any."""
    steps = 6
    bags = _bags(capacity=300, depth=2)
    window = _Window(bags, _batches(16))
    for _ in range(6):
        window.step()
    torch.cuda.synchronize(DEVICE)
    sites: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[_innermost_distcache_frame(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                window.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    per_batch = {site: n / steps for site, n in sorted(sites.items())}
    report = os.environ.get("DISTCACHE_SYNC_REPORT")
    if report:
        payload = {"device": torch.cuda.get_device_name(DEVICE), "syncs_per_batch": per_batch}
        Path(report).write_text(json.dumps(payload, indent=2) + "\n")
    listed = "; ".join(f"{n:g}/batch at {site}" for site, n in per_batch.items())
    assert not per_batch, f"{sum(per_batch.values()):g} host syncs per batch: {listed}"
