"""`Victims`: which cache slots a staging batch's misses take, in work that follows the batch.

Scoring every slot of the cache for every batch would cost O(capacity) a batch: a 5 % cache of
Criteo Terabyte has 9.4 M slots, against a few thousand rows loaded a step. So the policy
scores only *candidates*, and `select.select_largest` picks the `want` best of them (ties to the
earlier candidate):

1. free slots (never loaded since the cache was cleared), the next `size` of them, until the
   host has seen a plan leave none (`Scheduler.note_counts`);
2. a *sweep* of `scan` consecutive slots, from where the previous batch's sweep ended: loaded
   rows compete there by the policy's keys (look-ahead: rows the window does not use first,
   then the farthest next use). `scan` is at least the pinned slots' bound plus `size` (the
   scheduler's `_scan`), so the sweep always offers as many unpinned slots as a batch can miss:
   victims never run short while the cache has room.
When `scan` covers the cache, every slot is scored (for small caches): the policy's exact
choice.

The sweep visits every slot every `capacity / scan` batches, so a row the window no longer uses
waits at most that long to be offered. On power-law traces (`benchmarks/cache_policies.py`,
5-20 % caches, L = 64) the look-ahead policy loads about as many rows from these candidates as
from every slot (within 0.5 %), and LRU's sweep as many as exact LRU: an expiry queue of the
rows the window had left, offered oldest first (Bagpipe's order) beside the sweep, saved at
most 1.1 % of the loads (mostly under 0.1 %) and was removed, with its 20 bytes a slot and
some 50 small ops a batch. Pinned slots score -1 (never taken). The work is O(size + scan): a
few times the batch's ids, never the capacity, with fixed shapes and no read-back.
"""

from __future__ import annotations

import torch

from distcache.cache import fused
from distcache.cache.policies import EvictionPolicy, LookaheadPolicy
from distcache.cache.residency import Residency
from distcache.cache.select import select_largest


class Victims:
    """Chooses victim slots for one cache (`choose`).

    Args:
        residency: the cache's maps.
        policy: scores the candidates (bound to `residency`).
    """

    def __init__(self, residency: Residency, policy: EvictionPolicy):
        self.residency = residency
        self.policy = policy
        device = residency.row_of.device
        self._hand = torch.zeros((), dtype=torch.int64, device=device)  # the sweep (2) resumes here
        # `fused.kernels`: a full cache's look-ahead candidates scored in one kernel (the
        # scheduler's `fused`); None: by the torch ops.
        self.kernels: dict | None = None

    def clear(self) -> None:
        self._hand.zero_()

    def choose(
        self,
        seq: torch.Tensor,
        want: torch.Tensor,
        size: int,
        fill: torch.Tensor,
        scan: int,
        *,
        free: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slots for `want` misses of batch `seq`.

        Args:
            seq: 0-dim int32, the staging batch.
            want: 0-dim int64, its misses.
            size: most victims a batch can take (the result's length is `size + 1`).
            fill: 0-dim int64, the first free slot (slots [fill, capacity) are free); moved
                past the free slots taken.
            scan: slots swept (2 above); every slot, and nothing else, if at least the
                capacity.
            free: offer free slots (1 above); False once the cache is known to be full
                (`fill` at the capacity, which only `clear()` undoes).

        Returns:
            victims: `[size + 1]` int64 the chosen slots first, then the sentinel slot.
            taken: 0-dim int64, min(want, candidates).
            candidates: 0-dim int64, the unpinned slots offered.
        """
        res, cap = self.residency, self.residency.capacity
        device = fill.device
        live = None
        found = self.kernels if isinstance(self.policy, LookaheadPolicy) else None
        if found is not None and (not free or "candidates_free" in found):
            if free:  # (the C kernels)
                slots, keys, hist = fused.candidates_free(
                    found, res, self.policy, self._hand, fill, seq, size, scan
                )
            else:
                slots, keys, hist = fused.candidates(found, res, self.policy, self._hand, seq, scan)
            picked, taken, candidates = fused.select_counted(
                found, keys, hist, self.policy.classes, want, size + 1
            )
            victims = slots.index_select(0, picked)
            if free:
                _take_free(fill, victims, cap)
            return victims, taken, candidates
        if scan >= cap:  # every slot: free ones (from `fill` on) first
            slots = torch.arange(cap, device=device)
            is_free = slots >= fill if free else None
        else:
            swept = self._hand + torch.arange(scan + 1, device=device)  # 2: a sweep
            swept = torch.where(swept < cap, swept, swept - cap)  # (hand, scan < cap)
            self._hand.copy_(swept[scan])  # where the next sweep starts
            swept = swept[:scan]
            if free:  # 1: the next free slots, first; the sweep offers only loaded ones
                first = fill + torch.arange(size, device=device)
                first = torch.where(first < cap, first, res.trash_slot)
                slots = torch.cat([first, swept])
                live = torch.cat([first < cap, swept < fill])
                is_free = torch.zeros_like(live)
                is_free[:size] = True
            else:  # full: every slot is loaded (`fill` is the capacity)
                slots, is_free = swept, None
        victims, taken, candidates = self._best(slots, live, is_free, seq, want, size)
        if free:
            _take_free(fill, victims, cap)
        return victims, taken, candidates

    def _best(
        self,
        slots: torch.Tensor,
        live: torch.Tensor | None,
        free: torch.Tensor | None,
        seq: torch.Tensor,
        want: torch.Tensor,
        size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `want` best of the candidate `slots` `[m]` that are `live` (None: all) and
        unpinned: `free` ones `[m]` (None: none) first, then by the policy's keys, ties to the
        earlier. Returns `choose`'s results."""
        res = self.residency
        unpinned = self.residency.pin.index_select(0, slots) == 0
        live = unpinned if live is None else live & unpinned
        keys = self.policy.keys(slots, seq)
        if free is not None:
            keys = torch.where(free, self.policy.classes - 1, keys)
        keys = torch.where(live, keys, -1)
        picked, taken, candidates = select_largest(keys, self.policy.classes, want, size + 1)
        slots = torch.cat([slots, slots.new_full((1,), res.sentinel_slot)])
        victims = slots.index_select(0, picked)  # padding: index len(keys), the sentinel slot
        return victims, taken, candidates


def _take_free(fill: torch.Tensor, victims: torch.Tensor, capacity: int) -> None:
    """`fill` moved past the free slots among `victims` `[size + 1]` (they are taken)."""
    chosen = victims[:-1]
    fill.add_((chosen >= fill).logical_and_(chosen < capacity).sum())
