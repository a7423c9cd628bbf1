"""Eviction policies: the future-aware `lookahead` policy and the reactive `lru` / `lfu` baselines.

A policy scores the cache slots (`victim_keys`, higher = evict first); the scheduler decides
which slots may be evicted at all (never a pinned slot) and takes free slots first. All policies
share one scheduler, so one code base measures them side by side.
"""

from __future__ import annotations

import abc

import torch

from distcache.cache.residency import Residency

_INF = torch.iinfo(torch.int32).max
_MAX_COUNT = torch.iinfo(torch.int32).max
_FAR = 1 << 30  # distance class of a row with no known next use


class EvictionPolicy(abc.ABC):
    """Scores cache slots for eviction from what the policy knows of past (and future) batches."""

    #: Reactive policies see no future batch: their misses are loaded when a batch is looked up.
    reactive: bool = True

    def bind(self, num_rows: int, capacity: int, device: torch.device) -> None:
        """Allocate the policy's per-row or per-slot state."""

    def on_enqueue(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Batch `seq` with unique rows `rows` `[u]` entered the look-ahead window; `slots` `[u]`
        are their current slots (-1: not resident)."""

    def on_stage(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Batch `seq` is made resident: unique `rows` `[u]` now sit in `slots` `[u]`."""

    @abc.abstractmethod
    def victim_keys(self, residency: Residency, seq: int) -> torch.Tensor:
        """Eviction scores `[capacity]` int64 >= 0 for staging batch `seq`; higher goes first.

        Computed from per-slot state only (contiguous passes over the slots): per-row state is
        mirrored into slots when a batch's rows change, so no gather over the table is needed.
        """


class LookaheadPolicy(EvictionPolicy):
    """Evict the row whose next use inside the look-ahead window is farthest; among rows the
    window does not use, the one used in the fewest batches so far.

    With a window covering the whole trace and no prefetch depth this is Belady's optimum.

    Per row, one int64 record (so a batch costs one gather and one scatter over the table):
    `NEXT_USE` (seq of the earliest not-yet-staged batch that uses the row, or INF), `LAST_POS`
    (absolute position of its latest occurrence in `_next`; positions grow with seq, so that
    occurrence belongs to a not-yet-staged batch iff it lies at or after the first such batch's
    first position) and `COUNT` (batches seen using it). `_next` is one flat buffer holding, for
    every row occurrence in a not-yet-staged batch, the seq of the row's next use after it; a new
    batch fills in its rows' previous occurrences with one scatter, and staging a batch reads its
    slice. Both cost O(unique rows of the batch), whatever the window's length.
    """

    reactive = False
    NEXT_USE, LAST_POS, COUNT = 0, 1, 2

    def bind(self, num_rows: int, capacity: int, device: torch.device) -> None:
        self.rows = torch.empty(num_rows, 3, dtype=torch.int64, device=device)  # [rows, 3]
        self.rows[:, self.NEXT_USE] = _INF
        self.rows[:, self.LAST_POS] = -1
        self.rows[:, self.COUNT] = 0
        # Per-slot copies of NEXT_USE and COUNT, built when victims are first needed (a cache
        # that never fills never pays for them).
        self.slot_next_use: torch.Tensor | None = None
        self.slot_count: torch.Tensor | None = None
        self._next = torch.empty(0, dtype=torch.int64, device=device)  # [live occurrences]
        self._base = 0  # absolute position of _next[0]
        self._end = 0  # absolute position of the next occurrence
        self._start: dict[int, int] = {}  # seq -> absolute position of its first occurrence
        self._first_unstaged = 0

    def on_enqueue(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        n = rows.numel()
        self._reserve(n)
        record = self.rows[rows]  # [u, 3]
        prev = record[:, self.LAST_POS]  # [u] previous occurrence, or -1
        # Rows with an occurrence in a not-yet-staged batch: that occurrence learns this use.
        waiting = prev >= self._start.get(self._first_unstaged, self._end)
        self._next[prev[waiting] - self._base] = seq
        # Rows with no pending occurrence: this batch is their next use.
        record[:, self.NEXT_USE].masked_fill_(~waiting, seq)
        record[:, self.LAST_POS] = torch.arange(self._end, self._end + n, device=rows.device)
        record[:, self.COUNT].add_(1)
        self.rows[rows] = record
        lo = self._end - self._base
        self._next[lo : lo + n] = _INF
        self._start[seq] = self._end
        self._end += n
        resident = slots >= 0
        self._mirror(slots[resident], record[resident])

    def on_stage(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        if seq != self._first_unstaged:
            raise AssertionError(
                f"batches must be staged in order: got {seq}, expected {self._first_unstaged}"
            )
        lo = self._start.pop(seq) - self._base
        next_use = self._next[lo : lo + rows.numel()]
        self.rows[rows, self.NEXT_USE] = next_use
        self._first_unstaged += 1
        if self.slot_next_use is not None:
            self.slot_next_use[slots] = next_use
            # A row loaded by this batch brings its count into its new slot.
            self.slot_count[slots] = self.rows[rows, self.COUNT]

    def _mirror(self, slots: torch.Tensor, record: torch.Tensor) -> None:
        if self.slot_next_use is not None:
            self.slot_next_use[slots] = record[:, self.NEXT_USE]
            self.slot_count[slots] = record[:, self.COUNT]

    def _reserve(self, n: int) -> None:
        """Make room for n more occurrences, dropping those of staged batches."""
        if self._end + n - self._base <= self._next.numel():
            return
        live = self._start.get(self._first_unstaged, self._end)
        kept = self._next[live - self._base : self._end - self._base]
        grown = torch.empty(
            max(2 * (kept.numel() + n), 1024), dtype=torch.int64, device=self._next.device
        )
        grown[: kept.numel()] = kept
        self._next, self._base = grown, live

    def victim_keys(self, residency: Residency, seq: int) -> torch.Tensor:
        if self.slot_next_use is None:
            record = self.rows[residency.row_of.clamp(min=0)]  # [capacity, 3]
            self.slot_next_use = record[:, self.NEXT_USE].contiguous()
            self.slot_count = record[:, self.COUNT].contiguous()
        next_use = self.slot_next_use
        distance = torch.where(next_use == _INF, _FAR, next_use - seq)
        return (distance << 32) | (_MAX_COUNT - self.slot_count.clamp(max=_MAX_COUNT))


class LRUPolicy(EvictionPolicy):
    """Evict the least recently used row (recency counted in batches)."""

    def bind(self, num_rows: int, capacity: int, device: torch.device) -> None:
        self.last_use = torch.zeros(capacity, dtype=torch.int64, device=device)

    def on_stage(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self.last_use[slots] = seq

    def victim_keys(self, residency: Residency, seq: int) -> torch.Tensor:
        return seq - self.last_use


class LFUPolicy(EvictionPolicy):
    """Evict the row used in the fewest batches so far (counts kept for every row, resident or
    not, so a returning hot row keeps its history), least recently used among equals."""

    def bind(self, num_rows: int, capacity: int, device: torch.device) -> None:
        self.count = torch.zeros(num_rows, dtype=torch.int32, device=device)
        self.slot_count = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.last_use = torch.zeros(capacity, dtype=torch.int64, device=device)

    def on_stage(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        count = (self.count[rows] + 1).clamp_(max=_MAX_COUNT)
        self.count[rows] = count
        self.slot_count[slots] = count.long()
        self.last_use[slots] = seq

    def victim_keys(self, residency: Residency, seq: int) -> torch.Tensor:
        age = (seq - self.last_use).clamp_(max=(1 << 32) - 1)
        return ((_MAX_COUNT - self.slot_count) << 32) | age


def make_policy(name: str) -> EvictionPolicy:
    """The policy object for a config name ('lookahead', 'lru', 'lfu')."""
    policies = {"lookahead": LookaheadPolicy, "lru": LRUPolicy, "lfu": LFUPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}: expected one of {tuple(policies)}")
    return policies[name]()
