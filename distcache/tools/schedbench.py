"""The timed look-ahead scheduler of `python -m distcache calibrate`: what a cache's victim
choice and bookkeeping cost per batch.

`measure_schedule_costs` runs the engine's `Scheduler` (the look-ahead policy, as
`CacheEngine` builds it) alone, without rows to move, on power-law batches of a few sizes and
caches of a few capacities, once each cache is full, and fits each batch's enqueue + stage +
release as `fixed + ids·s_per_id + candidates·s_per_candidate`: the ids entering the window
(sorted, deduplicated, linked to their rows' earlier uses) and the slots the victim choice
scores (`Victims`: the sweep of `Scheduler._scan`'s slots, and the free slots while there are
any, or every slot of a small cache). The planner prices a look-ahead cache's scheduling from the
same two counts (`distcache.planner.rates.scheduled_candidates`). On a GPU each batch is timed
by the device's work (`devicetime.DeviceClock`): its launches cost the host, which the model
prices apart, and a host-bound timing hides the per-id cost under them.

Problem sizes: `distcache.tools.microbench.CalibrationSizes`.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from distcache.errors import DistcacheConfigError
from distcache.tools.devicetime import DeviceClock
from distcache.tools.microbench import FULL

MAX_FILL_BATCHES = 2_000  # batches a cache may take to fill


@dataclass(frozen=True, kw_only=True)
class ScheduleCosts:
    """A look-ahead cache's scheduling time per batch: `fixed_s + ids·s_per_id +
    candidates·s_per_candidate` (the last two: `Topology.schedule_s_per_id`,
    `Topology.schedule_s_per_candidate`; the fixed part is reported, not priced)."""

    fixed_s: float
    s_per_id: float
    s_per_candidate: float
    points: tuple[tuple[float, float, float], ...] = ()
    """(seconds, ids, candidates) per batch of each (batch size, capacity) timed."""

    def seconds(self, ids: float, candidates: float) -> float:
        """The fitted time of a batch of `ids` ids whose victims score `candidates` slots."""
        return self.fixed_s + ids * self.s_per_id + candidates * self.s_per_candidate


@dataclass(frozen=True)
class SchedulePoint:
    """One (batch size, capacity) `measure_schedule_costs` times."""

    seconds: float  # median per batch
    ids: float
    candidates: float  # slots scored per batch (mean)
    offered: float  # of them unpinned and live (`StagePlan.counts[CANDIDATES]`, mean)
    distinct: float  # distinct rows of a batch (mean)


def measure_schedule_costs(
    *,
    rows: int = FULL.schedule_rows,
    points: Sequence[tuple[int, int]] = FULL.schedule_points,
    alpha: float = FULL.lookup_alpha,
    lookahead: int = 8,
    prefetch_depth: int = 1,
    repeats: int = 5,
    device: str = "cpu",
) -> ScheduleCosts | None:
    """Time the scheduler's work per batch at each (ids per batch, cache slots) of `points`
    and fit `fixed + ids·s_per_id + candidates·s_per_candidate` by least relative squares.

    Each batch is released (its training done) before the next one enters the window and the
    oldest waiting one is staged, `prefetch_depth` staged ahead of the one training, as the
    engine runs them; the points' batches are timed in turns. Candidates are the slots
    `Victims.choose` scores, as the scheduler passes them: every slot when its sweep covers
    the cache, else the sweep's (and the free slots', while there are any).

    Returns None where the noise leaves a per-id or per-candidate cost non-positive.

    Args:
        rows: Table rows.
        points: >= 3 (ids per batch, cache slots), chosen so that ids and candidates do not
            move together (a small cache is scored whole); each cache must hold
            `prefetch_depth + 2` batches' distinct rows.
        alpha: Power-law exponent of the ids.
        lookahead: Batches in the look-ahead window (L).
        prefetch_depth: Batches staged ahead (K).
        repeats: 8 x repeats batches are timed per point, once its cache is full.
        device: 'cpu' or 'cuda'.
    """
    if len(set(points)) < 3:
        raise DistcacheConfigError(f"points must hold >= 3 distinct (ids, slots), got {points}")
    runs = [
        _ScheduleRun(
            rows=rows, ids=n, capacity=c, alpha=alpha, lookahead=lookahead,
            prefetch_depth=prefetch_depth, device=device,
        )
        for n, c in points
    ]  # fmt: skip
    for run in runs:
        run.fill()
    for _ in range(8 * repeats):  # in turns: the machine's drift touches every point alike
        for run in runs:
            run.step()
    return fit_schedule_costs(
        [(p.seconds, p.ids, p.candidates) for p in (run.point() for run in runs)]
    )


def fit_schedule_costs(points: Sequence[tuple[float, float, float]]) -> ScheduleCosts | None:
    """`fixed + ids·s_per_id + candidates·s_per_candidate` fitted to (seconds, ids,
    candidates) `points` by least relative squares, the two costs kept >= 0: where the full
    fit makes one of them non-positive, the better of the two fits without it (that cost 0:
    on a GPU the launches' fixed cost can hide the smaller one, and the engine's candidates
    grow with its batch's rows, so the other absorbs it). None where neither fit leaves a
    positive cost. A negative fixed part is dropped: 0."""
    t = np.array([p[0] for p in points], dtype=np.float64)
    design = np.array([(1.0, p[1], p[2]) for p in points], dtype=np.float64) / t[:, None]
    best: tuple[float, np.ndarray] | None = None
    for kept in ((0, 1, 2), (0, 1), (0, 2)):
        coef, *_ = np.linalg.lstsq(design[:, kept], np.ones_like(t), rcond=None)
        if min(coef[1:]) <= 0:
            continue
        full = np.zeros(3)
        full[list(kept)] = coef
        if len(kept) == 3:
            best = (0.0, full)
            break
        residual = float(np.sum((design @ full - 1.0) ** 2))
        if best is None or residual < best[0]:
            best = (residual, full)
    if best is None:
        return None
    fixed, per_id, per_candidate = best[1]
    return ScheduleCosts(
        fixed_s=max(0.0, float(fixed)),
        s_per_id=float(per_id),
        s_per_candidate=float(per_candidate),
        points=tuple((float(a), float(b), float(c)) for a, b, c in points),
    )


def time_schedule(
    *, rows: int, ids: int, capacity: int, alpha: float = FULL.lookup_alpha, lookahead: int = 8,
    prefetch_depth: int = 1, steps: int = 40, device: str = "cpu",
) -> SchedulePoint:  # fmt: skip
    """Median seconds of `steps` batches' enqueue + stage_next + release on a full cache of
    `capacity` slots, with the slots scored (one point of `measure_schedule_costs`)."""
    run = _ScheduleRun(
        rows=rows, ids=ids, capacity=capacity, alpha=alpha, lookahead=lookahead,
        prefetch_depth=prefetch_depth, device=device,
    )  # fmt: skip
    run.fill()
    for _ in range(steps):
        run.step()
    return run.point()


class _ScheduleRun:
    """One cache's `Scheduler` (the look-ahead policy, as `CacheEngine` builds it) fed
    power-law batches as the engine feeds them: the batch training is released, the next one
    enters the window, the oldest waiting one is staged, `prefetch_depth` staged ahead."""

    def __init__(
        self, *, rows: int, ids: int, capacity: int, alpha: float, lookahead: int,
        prefetch_depth: int, device: str,
    ):  # fmt: skip
        from distcache.cache.config import CacheConfig
        from distcache.cache.policies import make_policy
        from distcache.cache.scheduler import Scheduler

        self.dev = torch.device(device)
        self._clock = DeviceClock(self.dev)  # on a GPU the device's work, not the launches
        self.ids, self.capacity, self.depth = ids, capacity, prefetch_depth
        # The passes the engine runs by default (`CacheConfig.fused`), launched one by one:
        # a graph's replay would not call `Victims.choose`, which counts the candidates.
        self.sched = Scheduler(
            rows, capacity, make_policy("lookahead"), lookahead=lookahead, device=self.dev,
            fused=CacheConfig().fused,
        )  # fmt: skip
        self._batches = _power_law(rows, alpha, ids, self.dev)
        self._scored: list[int] = []  # slots `Victims.choose` was asked to score, per batch
        choose = self.sched.victims.choose

        def counted(seq, want, size, fill, scan, *, free=True):
            self._scored.append(capacity if scan >= capacity else scan + size * free)
            return choose(seq, want, size, fill, scan, free=free)

        self.sched.victims.choose = counted  # this instance only: not the per-batch path
        self._staged: deque = deque()
        self.full = False  # a plan has left no free slot (the engine's `note_counts`)
        self.times: list[float] = []  # per batch staged on a full cache
        self._covered: list[bool] = []  # (`DeviceClock.time`)
        self._offered: list[int] = []
        self._distinct: list[int] = []
        for _ in range(lookahead - prefetch_depth):
            self.sched.enqueue(next(self._batches))

    def fill(self) -> None:
        """Stage batches until the cache is full (the steps after it choose victims)."""
        for _ in range(MAX_FILL_BATCHES):
            if self.full:
                return
            self.step()
        raise DistcacheConfigError(
            f"a cache of {self.capacity} slots did not fill in {MAX_FILL_BATCHES} batches of "
            f"{self.ids} ids"
        )

    def step(self) -> None:
        """One batch through the scheduler, timed once the cache is full."""
        from distcache.cache.plan import CANDIDATES, FREE, UNIQUE

        batch = next(self._batches)

        def schedule() -> None:
            if len(self._staged) > self.depth:  # the batch training: done
                self.sched.release(self._staged.popleft())
            self.sched.enqueue(batch)
            self._staged.append(self.sched.stage_next())

        seconds, covered = self._clock.time(schedule)
        counts = self._staged[-1].counts.tolist()
        self.sched.note_counts(counts)  # as the engine does when the plan is looked up
        if self.full:  # staged on a full cache: victims chosen, no free slot offered
            self.times.append(seconds)
            self._covered.append(covered)
            self._offered.append(counts[CANDIDATES])
            self._distinct.append(counts[UNIQUE])
        self.full = counts[FREE] == 0

    def point(self) -> SchedulePoint:
        """The point: its batches' median seconds (of those whose queueing the device clock's
        spin covered, where any was)."""
        covered = [t for t, c in zip(self.times, self._covered, strict=True) if c]
        return SchedulePoint(
            seconds=statistics.median(covered or self.times),
            ids=float(self.ids),
            candidates=statistics.mean(self._scored[-len(self.times) :]),
            offered=statistics.mean(self._offered),
            distinct=statistics.mean(self._distinct),
        )


def _power_law(rows: int, alpha: float, ids: int, dev: torch.device) -> Iterator[torch.Tensor]:
    """Endless power-law batches of `ids` ids `[ids]` int64 on `dev`, drawn 64 at a time."""
    from distcache.data.traces import zipf_trace

    for seed in itertools.count(3):
        trace = zipf_trace(rows=rows, alpha=alpha, batch=ids, batches=64, seed=seed)
        yield from trace.ids.to(dev).view(64, ids)
