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

    def on_enqueue(self, seq: int, rows: torch.Tensor) -> None:
        """Batch `seq` with unique rows `rows` `[u]` entered the look-ahead window."""

    def on_stage(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Batch `seq` is made resident: unique `rows` `[u]` now sit in `slots` `[u]`."""

    @abc.abstractmethod
    def victim_keys(self, residency: Residency, seq: int) -> torch.Tensor:
        """Eviction scores `[capacity]` int64 >= 0 for staging batch `seq`; higher goes first."""


class LookaheadPolicy(EvictionPolicy):
    """Evict the row whose next use inside the look-ahead window is farthest; among rows the
    window does not use, the one used in the fewest batches so far.

    With a window covering the whole trace and no prefetch depth this is Belady's optimum.

    State per row (int32): `next_use` (seq of the earliest not-yet-staged batch that uses the row,
    or INF), `last_seen`/`last_pos` (the latest enqueued batch using it and its position in that
    batch's unique rows), and `count` (batches seen using it). Per not-yet-staged batch,
    `next_of[seq]` `[u]` holds each of its rows' next use after it, filled in as later batches
    arrive; so both enqueue and stage cost O(unique rows x window), with no search over the window.
    """

    reactive = False

    def bind(self, num_rows: int, capacity: int, device: torch.device) -> None:
        def per_row(fill: int) -> torch.Tensor:
            return torch.full((num_rows,), fill, dtype=torch.int32, device=device)

        self.next_use = per_row(_INF)
        self.last_seen = per_row(-1)
        self.last_pos = per_row(0)
        self.count = per_row(0)
        self._next_of: dict[int, torch.Tensor] = {}
        self._first_unstaged = 0

    def on_enqueue(self, seq: int, rows: torch.Tensor) -> None:
        prev = self.last_seen[rows]  # [u]
        # Rows with an earlier occurrence in a not-yet-staged batch: that batch learns this use.
        waiting = prev >= self._first_unstaged
        if bool(waiting.any()):
            pos = self.last_pos[rows]
            for b in range(self._first_unstaged, seq):
                mask = waiting & (prev == b)
                self._next_of[b][pos[mask].long()] = seq
        # Rows with no pending occurrence: this batch is their next use.
        fresh = rows[~waiting]
        self.next_use[fresh] = seq
        self.last_seen[rows] = seq
        self.last_pos[rows] = torch.arange(rows.numel(), dtype=torch.int32, device=rows.device)
        self.count[rows] = (self.count[rows] + 1).clamp_(max=_MAX_COUNT)
        self._next_of[seq] = torch.full(
            (rows.numel(),), _INF, dtype=torch.int32, device=rows.device
        )

    def on_stage(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        if seq != self._first_unstaged:
            raise AssertionError(
                f"batches must be staged in order: got {seq}, expected {self._first_unstaged}"
            )
        self.next_use[rows] = self._next_of.pop(seq)
        self._first_unstaged += 1

    def victim_keys(self, residency: Residency, seq: int) -> torch.Tensor:
        rows = residency.row_of.clamp(min=0)
        next_use = self.next_use[rows].long()
        distance = torch.where(next_use == _INF, _FAR, next_use - seq)
        return (distance << 32) | (_MAX_COUNT - self.count[rows].long())


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
        self.last_use = torch.zeros(capacity, dtype=torch.int64, device=device)

    def on_stage(self, seq: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self.count[rows] = (self.count[rows] + 1).clamp_(max=_MAX_COUNT)
        self.last_use[slots] = seq

    def victim_keys(self, residency: Residency, seq: int) -> torch.Tensor:
        count = self.count[residency.row_of.clamp(min=0)].long()
        return ((_MAX_COUNT - count) << 32) | (seq - self.last_use).clamp(max=(1 << 32) - 1)


def make_policy(name: str) -> EvictionPolicy:
    """The policy object for a config name ('lookahead', 'lru', 'lfu')."""
    policies = {"lookahead": LookaheadPolicy, "lru": LRUPolicy, "lfu": LFUPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}: expected one of {tuple(policies)}")
    return policies[name]()
