"""Eviction policies: the future-aware `lookahead` policy and the reactive `lru` / `lfu` baselines.

A policy scores candidate slots (`keys`, higher = evict first) as small bounded classes, so
that the scheduler can select victims by counting (`select.select_largest`) with no sort and no
device read-back. The scheduler decides which slots are candidates (a few per id of the batch,
never every slot: `cache/victims.py`) and which may be evicted at all (never a pinned slot);
free slots (never loaded since `bind`) go first whatever their score. All policies share one
scheduler, so one code base measures them side by side.

State lives per cache slot (the next use of a slot's row in the window is the residency's,
`Residency.next_use`), not per table row, except LFU's use counts, which must survive eviction
(4 bytes per row). Every update is a fixed-shape scatter: entries that should not land are sent
to the trash slot.
"""

from __future__ import annotations

import abc

import torch

from distcache.cache.residency import Residency
from distcache.errors import DistcacheConfigError

_CLASS_BITS = 18  # 2**18 histogram bins at most: a few passes over 256 K counters per batch


def _bits(n: int) -> int:
    """Bits needed for the values 0 .. n - 1."""
    return max(1, (n - 1).bit_length())


def _class_bits(capacity: int) -> int:
    """Bits of a policy's classes for a cache of `capacity` slots: about twice as many classes
    as slots, at least 256 and at most 2**18 (the histogram that selects victims has one bin
    per class)."""
    return min(_CLASS_BITS, max(8, capacity.bit_length() + 1))


class EvictionPolicy(abc.ABC):
    """Scores cache slots for eviction from what the policy knows of past (and future) batches."""

    #: Reactive policies see no future batch: their misses are loaded when a batch is looked up.
    reactive: bool = True
    #: Classes of `keys`: [0, classes), set by `bind`.
    classes: int

    def bind(self, residency: Residency, lookahead: int) -> None:
        """Allocate the policy's state for a cache (called again after `clear`)."""
        self.residency = residency
        self.trash = residency.trash_slot

    @abc.abstractmethod
    def on_stage(
        self,
        seq: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        loaded: torch.Tensor,
    ) -> None:
        """Batch `seq` (0-dim int32 on the device, as every seq a policy is given) is made
        resident.

        Args:
            rows: `[n]` its distinct rows, padded with the sentinel row.
            slots: `[n]` int64 the slot of each row; the sentinel slot for padding.
            loaded: `[n]` bool rows loaded by this staging (not hits).
        """

    @abc.abstractmethod
    def keys(self, slots: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """Eviction classes `[m]` (int32) in [0, classes) of the resident `slots` `[m]` (int64)
        for staging batch `seq`; higher goes first."""


class LookaheadPolicy(EvictionPolicy):
    """Evict the row whose next use inside the look-ahead window is farthest; among rows the
    window does not use, the one used by the fewest batches since it was loaded.

    With a window covering the whole trace, no prefetch depth and every slot a candidate this
    is Belady's optimum. Per slot: the row's next use (`Residency.next_use`, kept by the
    scheduler with the window) and its uses since it was loaded (a better second key than
    recency on the traces of `benchmarks/cache_policies.py`).
    """

    reactive = False

    def bind(self, residency: Residency, lookahead: int) -> None:
        super().bind(residency, lookahead)
        slots, device = residency.capacity + 2, residency.row_of.device
        self.uses = torch.zeros(slots, dtype=torch.int32, device=device)
        self._one = torch.ones(1, dtype=torch.int32, device=device)  # counted with, expanded
        # The distance class of a row the window does not use: one more than the farthest next
        # use a window of L future batches can hold (L, when nothing is staged ahead).
        self.far = lookahead + 1
        self.use_bits = max(1, _class_bits(residency.capacity) - _bits(self.far + 1))
        self.classes = (self.far + 1) << self.use_bits

    def on_stage(self, seq, rows, slots, loaded) -> None:  # noqa: ANN001
        self.uses.index_fill_(0, torch.where(loaded, slots, self.trash), 0)
        self.uses.index_add_(0, slots, self._one.expand(slots.numel()))

    def keys(self, slots: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        # int32 throughout: seqs stay below 2**31, classes below 2**18 (half the bytes of int64)
        next_use = self.residency.next_use.index_select(0, slots)
        distance = (next_use - seq).clamp_(0, self.far)  # NO_USE -> far
        top = (1 << self.use_bits) - 1
        rarity = top - self.uses.index_select(0, slots).clamp_(max=top)
        return (distance << self.use_bits) | rarity


class LRUPolicy(EvictionPolicy):
    """Evict the least recently used row (recency counted in batches, saturating at
    `classes - 1`)."""

    def bind(self, residency: Residency, lookahead: int) -> None:
        super().bind(residency, lookahead)
        device, slots = residency.row_of.device, residency.capacity + 2
        self.classes = 1 << _class_bits(residency.capacity)
        self.last_use = torch.full((slots,), -self.classes, dtype=torch.int32, device=device)

    def on_stage(self, seq, rows, slots, loaded) -> None:  # noqa: ANN001
        self.last_use.scatter_(0, slots, seq.expand(slots.numel()))

    def keys(self, slots: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        age = seq - self.last_use.index_select(0, slots)
        return age.clamp_(0, self.classes - 1)


class LFUPolicy(EvictionPolicy):
    """Evict the row used in the fewest batches so far (counts kept for every row, resident or
    not, so a returning hot row keeps its history: 4 bytes per row), least recently used among
    equals. Counts saturate at 1023, ages at 255 batches (fewer for caches under 128 K slots)."""

    COUNT_BITS = 10

    def bind(self, residency: Residency, lookahead: int) -> None:
        super().bind(residency, lookahead)
        self.age_bits = max(0, _class_bits(residency.capacity) - self.COUNT_BITS)
        self.classes = 1 << (self.COUNT_BITS + self.age_bits)
        device, slots = residency.row_of.device, residency.capacity + 2
        self.count = torch.zeros(residency.num_rows + 2, dtype=torch.int32, device=device)
        self.slot_count = torch.zeros(slots, dtype=torch.int32, device=device)
        self.last_use = torch.zeros(slots, dtype=torch.int32, device=device)

    def on_stage(self, seq, rows, slots, loaded) -> None:  # noqa: ANN001
        rows = torch.where(slots == self.residency.sentinel_slot, self.residency.trash_row, rows)
        count = (self.count.index_select(0, rows) + 1).clamp_(max=(1 << self.COUNT_BITS) - 1)
        self.count.scatter_(0, rows, count)
        self.slot_count.scatter_(0, slots, count)
        self.last_use.scatter_(0, slots, seq.expand(slots.numel()))

    def keys(self, slots: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        rarity = (1 << self.COUNT_BITS) - 1 - self.slot_count.index_select(0, slots)
        age = (seq - self.last_use.index_select(0, slots)).clamp_(0, (1 << self.age_bits) - 1)
        return (rarity << self.age_bits) | age


def make_policy(name: str) -> EvictionPolicy:
    """The policy object for a config name ('lookahead', 'lru', 'lfu')."""
    policies = {"lookahead": LookaheadPolicy, "lru": LRUPolicy, "lfu": LFUPolicy}
    if name not in policies:
        raise DistcacheConfigError(
            f"unknown eviction policy {name!r}: expected one of {tuple(policies)}"
        )
    return policies[name]()
