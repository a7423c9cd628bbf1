"""`Victims`: which cache slots a staging batch's misses take, in work that follows the batch.

Scoring every slot of the cache for every batch would cost O(capacity) a batch: a 5 % cache of
Criteo Terabyte has 9.4 M slots, against a few thousand rows loaded a step. So the policy
scores only *candidates*, found where good victims are, and `select.select_largest` picks the
`want` best of them (ties to the earlier candidate):

1. free slots (never loaded since the cache was cleared), the next `size` of them, until the
   host has seen a plan leave none (`Scheduler.note_counts`);
2. expired rows, oldest first: `2 size` entries from the head of the `ExpiryQueue` (rows
   whose last use in the window has been staged; for reactive policies, every row in the
   order it was last used, which is LRU's order);
3. a *sweep* of `scan` consecutive slots, from where the previous batch's sweep ended: rows
   the window still uses compete there by their next use. `scan` is at least the pinned
   slots' bound plus `size` (the scheduler's `_scan`), so the sweep alone always offers as
   many unpinned slots as a batch can miss: victims never run short while the cache has room,
   whatever the queue holds.
When `scan` covers the cache, every slot is scored (as many slots as 1-3 would be, for small
caches): the policy's exact choice.

A slot is offered once: free slots only by 1, and 3 skips the slots that 2 offered (tagged
with the batch's seq). Pinned slots score -1 (never taken). The work is O(size + scan): a few
times the batch's ids, never the capacity, with fixed shapes and no read-back.
"""

from __future__ import annotations

import torch

from distcache.cache.expiry import ExpiryQueue
from distcache.cache.policies import EvictionPolicy
from distcache.cache.residency import NO_USE, Residency
from distcache.cache.select import select_largest


class Victims:
    """Chooses victim slots for one cache (`choose`) and keeps the expiry queue (`expire`).

    Args:
        residency: the cache's maps.
        policy: scores the candidates (bound to `residency`).
    """

    def __init__(self, residency: Residency, policy: EvictionPolicy):
        self.residency = residency
        self.policy = policy
        device = residency.row_of.device
        self.queue = ExpiryQueue(residency.capacity, device)
        # The seq of the batch whose queue candidates (2) offered the slot (the sweep skips those).
        self._offered = torch.full((residency.capacity + 2,), -1, dtype=torch.int32, device=device)
        self._hand = torch.zeros((), dtype=torch.int64, device=device)  # the sweep (3) resumes here

    def clear(self) -> None:
        self.queue.clear()
        self._offered.fill_(-1)
        self._hand.zero_()

    def expire(self, slots: torch.Tensor, next_use: torch.Tensor, got: torch.Tensor) -> None:
        """A staged batch's rows took `slots` `[n]`; those that `got` a slot and whose
        `next_use` `[n]` is `NO_USE` join the queue (reactive policies: every row)."""
        keep = got if self.policy.reactive else got & (next_use == NO_USE)
        self.queue.push(slots, keep)

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
            scan: slots swept (3 above); every slot, and nothing else, if at least the
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
        if scan >= cap:  # every slot: free ones (from `fill` on) first
            slots = torch.arange(cap, device=device)
            is_free = slots >= fill if free else None
            victims, taken, candidates, _ = self._best(slots, None, is_free, seq, want, size)
        else:
            _, queued, queued_live = self.queue.segment(2 * size)  # 2: expired, oldest first
            if not self.policy.reactive:
                queued_live &= res.next_use.index_select(0, queued) == NO_USE
            self._offered.scatter_(
                0, torch.where(queued_live, queued, res.trash_slot), seq.expand(queued.numel())
            )
            swept = self._hand + torch.arange(scan + 1, device=device)  # 3: a sweep
            swept = torch.where(swept < cap, swept, swept - cap)  # (hand, scan < cap)
            self._hand.copy_(swept[scan])  # where the next sweep starts
            swept = swept[:scan]
            swept_live = self._offered.index_select(0, swept) != seq
            if free:  # 1: the next free slots, first; the sweep offers only loaded ones
                first = fill + torch.arange(size, device=device)
                first = torch.where(first < cap, first, res.trash_slot)
                swept_live &= swept < fill
                slots = torch.cat([first, queued, swept])
                live = torch.cat([first < cap, queued_live, swept_live])
                is_free = torch.zeros_like(live)
                is_free[:size] = True
            else:  # full: every slot is loaded (`fill` is the capacity)
                slots = torch.cat([queued, swept])
                live = torch.cat([queued_live, swept_live])
                is_free = None
            victims, taken, candidates, chosen = self._best(slots, live, is_free, seq, want, size)
            # The queue keeps the live entries it offered that were not taken.
            at = size if free else 0
            self.queue.advance(queued, queued_live & ~chosen[at : at + queued.numel()])
        if free:  # the free slots taken: `fill` moves past them
            fill.add_((victims[:-1] >= fill).logical_and_(victims[:-1] < cap).sum())
        self.queue.forget(victims)
        return victims, taken, candidates

    def _best(
        self,
        slots: torch.Tensor,
        live: torch.Tensor | None,
        free: torch.Tensor | None,
        seq: torch.Tensor,
        want: torch.Tensor,
        size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `want` best of the candidate `slots` `[m]` that are `live` (None: all) and
        unpinned: `free` ones `[m]` (None: none) first, then by the policy's keys, ties to the
        earlier.
        Returns `choose`'s results and which candidates were chosen `[m + 1]` (bool)."""
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
        chosen = torch.zeros(slots.numel(), dtype=torch.bool, device=slots.device)
        chosen.index_fill_(0, picked, True)
        return victims, taken, candidates, chosen
