"""Trace simulation: replay batches of ids through a policy and count what the cache would do.

The simulation drives the real `CacheEngine` with zero-width rows, so it runs exactly the
scheduler, policies and batch flow that training runs, without moving bytes. Counted per run:
rows loaded, dirty rows written back (every row a batch uses is dirty after its update, as in
training), and critical-path misses (rows loaded while the batch that needs them waits).

Capacity semantics, shared by every policy: the cache holds at most C rows, and all unique rows
of a batch are resident when it is looked up. `lookahead` additionally keeps the rows of the
`prefetch_depth` batches staged ahead pinned, so it needs a little more room than the optimum.

`optimal` is Belady's offline optimum for this setting: with every future batch known, evict the
resident row, not used by the current batch, whose next use is farthest (the look-ahead policy
with a window spanning the whole trace and nothing staged ahead).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from distcache.cache.config import POLICIES, CacheConfig
from distcache.cache.engine import CacheEngine
from distcache.cache.plan import StagePlan
from distcache.constants import DEFAULT_LOOKAHEAD
from distcache.errors import DistcacheConfigError

SIM_POLICIES = (*POLICIES, "optimal")


@dataclass(frozen=True)
class SimResult:
    """What a cache did over a trace."""

    policy: str
    capacity: int
    lookahead: int
    prefetch_depth: int
    batches: int
    """Batches counted: those from `counted_from` on."""
    ids: int
    unique_ids: int
    """Distinct rows of the whole trace."""
    hits: int
    loads: int
    writebacks: int
    critical_misses: int
    seconds: float
    """Wall time of the replay of the counted batches (scheduler work; no rows are moved)."""
    counted_from: int = 0
    """The first batch counted (`simulate`'s `count_from`): ids, hits, loads, write-backs and
    critical misses are those of the batches from there on (hits and loads as they are staged,
    up to K batches early)."""

    @property
    def ids_per_s(self) -> float:
        return self.ids / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, float | int | str]:
        return {**asdict(self), "ids_per_s": self.ids_per_s}


def simulate(
    batches: Sequence[torch.Tensor],
    *,
    num_rows: int,
    capacity: int,
    policy: str = "lookahead",
    lookahead: int = DEFAULT_LOOKAHEAD,
    prefetch_depth: int = 1,
    device: torch.device | str = "cpu",
    count_from: int = 0,
) -> SimResult:
    """Replay `batches` (each `[n]` int64 ids in [0, num_rows)) through a cache.

    Args:
        batches: the trace, in training order.
        num_rows: size of the id space.
        capacity: cache rows.
        policy: 'lookahead', 'lru', 'lfu' or 'optimal' (Belady).
        lookahead: L, future batches visible to 'lookahead' (ignored by the others).
        prefetch_depth: K, batches staged ahead by 'lookahead' (ignored by the others).
        device: where the scheduler runs.
        count_from: count from this batch on (the steady state after a warm-up, once the
            cache is full): the counters as they stand when it is looked up are subtracted.

    Example::

        result = simulate(trace_batches, num_rows=10**6, capacity=20_000, policy="lru")
        print(result.loads, result.critical_misses)
    """
    if policy not in SIM_POLICIES:
        raise DistcacheConfigError(f"unknown policy {policy!r}: expected one of {SIM_POLICIES}")
    if not 0 <= count_from < max(len(batches), 1):
        raise DistcacheConfigError(
            f"count_from={count_from}: expected 0 <= count_from < {len(batches)} (the batches)"
        )
    if policy == "optimal":  # Belady: the whole trace visible, nothing staged ahead
        lookahead, prefetch_depth = max(len(batches), 1), 0
    elif policy != "lookahead":
        lookahead, prefetch_depth = 0, 0
    config = CacheConfig(
        capacity=min(capacity, num_rows),
        lookahead=lookahead,
        prefetch_depth=prefetch_depth,
        policy="lookahead" if policy == "optimal" else policy,
    )
    engine = CacheEngine(
        num_rows=num_rows,
        dim=0,
        config=config,
        device=device,
        name=f"simulate[{policy}]",
    )
    engine.scheduler.exact = policy == "optimal"  # the lower bound scores every slot
    before, stats, seen, seconds = _replay(engine, batches, lookahead, count_from)

    def counted(name: str) -> int:
        return getattr(stats, name) - (getattr(before, name) if before is not None else 0)

    return SimResult(
        policy=policy,
        capacity=engine.capacity,
        lookahead=lookahead,
        prefetch_depth=prefetch_depth,
        batches=len(batches) - count_from,
        # (the engine counts ids as they enter the window, up to L batches early)
        ids=sum(int(b.numel()) for b in batches[count_from:]),
        unique_ids=int(seen[:num_rows].sum()),
        hits=counted("hits"),
        loads=counted("loads"),
        writebacks=counted("writebacks"),
        critical_misses=counted("critical_misses"),
        seconds=seconds,
        counted_from=count_from,
    )


def _replay(
    engine: CacheEngine, batches: Sequence[torch.Tensor], lookahead: int, count_from: int
) -> tuple:
    """Train `batches` through `engine` as `simulate` describes: the counters when batch
    `count_from` is looked up and at the end, which rows were looked up, and the seconds from
    that batch on."""
    device = engine.device
    seen = torch.zeros(engine.scheduler.num_rows + 1, dtype=torch.bool, device=device)  # + sentinel
    feed = Feed(engine, lambda s: batches[s].to(device), lookahead, end=len(batches))
    start = time.perf_counter()
    before = None
    for t in range(len(batches)):
        if t == count_from:
            before = engine.stats()
            start = time.perf_counter()
        plan = feed.step(t)
        seen[plan.batch.rows] = True
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return before, engine.stats(), seen, seconds


class Feed:
    """Batches trained through an engine of zero-width rows as training drives it (what
    `simulate` replays): at step t the batches up to t + L enqueued (`batch(s)`: batch s's
    ids on the engine's device; none from `end` on), the oldest looked up, the next staged
    while it "trains", its update applied (nothing to update) and its rows released."""

    def __init__(
        self,
        engine: CacheEngine,
        batch: Callable[[int], torch.Tensor],
        lookahead: int,
        *,
        end: int | None = None,
    ):
        self.engine, self.batch, self.lookahead, self.end = engine, batch, lookahead, end
        self.enqueued = 0
        self._no_grad = torch.zeros(1, 0, device=engine.device)  # one zero-width "bag"

    def step(self, t: int) -> StagePlan:
        """Train step t; returns the plan it looked up."""
        engine = self.engine
        while (
            self.end is None or self.enqueued < self.end
        ) and self.enqueued <= t + self.lookahead:
            engine.enqueue(self.batch(self.enqueued))
            self.enqueued += 1
        engine.prefetch()
        plan = engine.lookup_plan()
        engine.prefetch()  # stage ahead while this batch "trains"
        bags = self._no_grad.new_zeros(plan.inverse.numel(), dtype=torch.int64)
        engine.apply_gradients(plan, self._no_grad, bags)
        return plan
