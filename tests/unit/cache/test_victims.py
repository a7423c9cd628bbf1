"""Victim selection (`Victims`) against a brute-force look-ahead policy.

The reference sees exactly what the scheduler's window sees: when batch s is staged, the
batches enqueued after it and not yet staged. It scores every evictable row (resident, not
pinned by a batch in flight or by batch s) by the distance to its next use among those batches
(none: farther than any) and then by the batches that used it since it was loaded (fewer goes
first); the scheduler's victims must be the reference's best, up to ties.
"""

from __future__ import annotations

import pytest
import torch

import distcache.cache.scheduler as scheduler_module
from distcache.cache.plan import LOADS, MISSES
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler

NONE = 10**9  # the reference's distance of a row no batch in the window uses


NUM_ROWS = 24


class BruteForceWindow:
    """Checks each staging of a trace against the reference policy (module docstring)."""

    def __init__(self, scheduler: Scheduler, trace: list[list[int]], depth: int):
        self.scheduler, self.trace, self.depth = scheduler, trace, depth
        self.uses: dict[int, int] = {}  # batches that used a row since it was loaded

    def resident(self) -> set[int]:
        rows = self.scheduler.residency.row_of[: self.scheduler.capacity]
        return {int(r) for r in rows if int(r) >= 0}

    def check(self, s: int, before: set[int], enqueued: int) -> None:
        """Batch s was staged; `before`: the resident rows before; batches < `enqueued` were
        enqueued (those after s are the window's)."""
        trace, capacity = self.trace, self.scheduler.capacity
        batch = set(trace[s])
        in_flight = {r for u in range(max(0, s - self.depth), s) for r in trace[u]}
        evicted = before - self.resident()
        misses = batch - before
        assert len(evicted) == max(0, len(misses) - (capacity - len(before)))  # free slots first
        evictable = before - in_flight - batch
        assert evicted <= evictable

        def key(row: int) -> tuple[int, int]:  # higher goes first
            later = [u for u in range(s + 1, enqueued) if row in trace[u]]
            return (later[0] - s if later else NONE, -self.uses[row])

        kept = evictable - evicted
        if evicted and kept:
            best_kept = max(kept, key=key)
            worst_taken = min(evicted, key=key)
            assert key(worst_taken) >= key(best_kept), (s, worst_taken, best_kept)
        for row in batch:
            self.uses[row] = 1 if row in misses else self.uses[row] + 1
        for row in evicted:
            del self.uses[row]

    def run(self) -> None:
        """Train the trace as the engine does: L batches enqueued beyond the training one,
        `depth` staged ahead of it, released after it trains."""
        scheduler, trace = self.scheduler, self.trace
        enqueued, staged, in_flight = 0, 0, []
        for t in range(len(trace)):
            while enqueued < len(trace) and enqueued <= t + scheduler.lookahead:
                scheduler.enqueue(torch.tensor(trace[enqueued], dtype=torch.int64))
                enqueued += 1
            while staged < min(len(trace), t + self.depth + 1):
                before = self.resident()
                plan = scheduler.stage_next()
                assert int(plan.counts[LOADS]) == int(plan.counts[MISSES])  # all got a slot
                self.check(staged, before, enqueued)
                in_flight.append(plan)
                staged += 1
            scheduler.release(in_flight.pop(0))


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("lookahead", [1, 3, 7])
@pytest.mark.parametrize("seed", range(6))
def test_lookahead_victims_are_a_brute_force_window_policys(depth, lookahead, seed):
    """Windows shorter than the trace, K = 0 (the farthest next use the window holds is L
    batches away: the edge of the distance classes) and K = 1."""
    depth = min(depth, lookahead)
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 6, (40,), generator=gen).tolist()
    trace = [sorted(set(torch.randint(0, NUM_ROWS, (n,), generator=gen).tolist())) for n in sizes]
    s = Scheduler(NUM_ROWS, 5 * (depth + 1) + 2, make_policy("lookahead"), lookahead=lookahead)
    BruteForceWindow(s, trace, depth).run()
    assert s.counters.evictions > 20


@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
def test_sampled_candidates_never_run_short(policy, monkeypatch):
    """With a cache larger than the sweep (`MIN_SCAN` lowered), the candidates still cover every
    miss while the cache has room for the batches in flight, and the maps stay consistent."""
    monkeypatch.setattr(scheduler_module, "MIN_SCAN", 1)
    gen = torch.Generator().manual_seed(0)
    s = Scheduler(3_000, 500, make_policy(policy), lookahead=6)
    in_flight = []
    for _ in range(4):
        s.enqueue(torch.randint(0, 3_000, (60,), generator=gen))
    for _ in range(300):
        while s.num_unstaged + s.num_staged <= 6:
            s.enqueue(torch.randint(0, 3_000, (60,), generator=gen))
        plan = s.stage_next()
        assert s._scan(60) < s.capacity  # the sweep is a sample of the cache
        assert int(plan.counts[LOADS]) == int(plan.counts[MISSES])
        in_flight.append(plan)
        if len(in_flight) > 2:
            s.release(in_flight.pop(0))
        res = s.residency
        resident = res.resident_slots()
        assert torch.equal(res.slot_of[res.row_of[resident]].long(), resident)
        assert torch.equal(res.row_of[plan.id_slots], plan.batch.ids)
    assert s.counters.evictions > 1_000


def test_staging_work_follows_the_batch_not_the_capacity():
    """The elements a steady-state staging reads and writes are the same for a cache ten times
    larger: no pass over every slot."""

    def work(capacity: int) -> list[tuple[str, int]]:
        s = Scheduler(8 * capacity, capacity, make_policy("lookahead"), lookahead=4)
        s.enqueue(torch.arange(capacity))  # fills the cache with rows the trace never uses
        s.release(s.stage_next())
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            s.enqueue(capacity + torch.randint(0, 4 * capacity, (1024,), generator=gen))
        for _ in range(3):
            s.release(s.stage_next())
            s.enqueue(capacity + torch.randint(0, 4 * capacity, (1024,), generator=gen))
        recorder = _Work()
        with recorder:
            plan = s.stage_next()
        assert int(plan.counts[LOADS]) > 900  # evicting
        return recorder.ops

    small, large = work(300_000), work(3_000_000)
    assert small == large
    assert max(n for _, n in small) <= 1 << 18  # the histogram's classes bound it


class _Work(torch.utils._python_dispatch.TorchDispatchMode):
    """Per op: the elements it produces, or for an in-place op the elements of its other
    tensor arguments (an index_copy_ into a big map touches as many as its index)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        name = func._schema.name
        if func._schema.is_mutable or name.endswith("_"):
            sizes = [t.numel() for t in tensors[1:]] or [0]
        elif func.is_view:
            sizes = [0]
        else:
            outs = out if isinstance(out, tuple | list) else (out,)
            sizes = [o.numel() for o in outs if isinstance(o, torch.Tensor)] or [0]
        self.ops.append((name, max(sizes)))
        return out
