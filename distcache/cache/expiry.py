"""`ExpiryQueue`: cache slots in the order their rows left the look-ahead window.

A row whose last use in the window has been staged is *expired*: no batch the scheduler knows
of needs it, so it is the best victim there is, and among expired rows the one that expired
first has waited longest for a use (Bagpipe keeps its cache the same way). The queue lets the
scheduler find such rows in O(batch) work, whatever the cache's size, instead of scoring every
slot.

It is a ring of slots on the device, appended at the tail (`push`) when a batch is staged, in
the batch's row order, and read from the head (`segment`). Entries are never removed in place:
an entry goes stale when its row is used again (a new batch enters the window and uses it),
evicted, or pushed again later, and is recognized by `pos`, the absolute position of each
slot's one live entry (`pos[ring[p % size]] == p` for a live entry at p). Reading the head:
the scheduler scores a segment of `width` entries, takes some, and `advance` keeps the live
entries it did not take at the segment's end, in order, so the head skips every stale entry it
has read. Appends per batch are bounded by the batch's rows and the head advances over what it
reads, so the ring stays short; should stale entries fill it, the oldest entries are
overwritten and lost to the queue (their slots stay valid victims for the scheduler's other
candidates; nothing is corrupted, since `pos` no longer matches).

Every method is fixed-shape device work: positions and counts live on the device, nothing is
read back. Memory: 4 bytes per ring cell (about 2 per slot) and 8 per slot.
"""

from __future__ import annotations

import torch


class ExpiryQueue:
    """Slots `[0, capacity)` in expiry order.

    Args:
        capacity: cache slots; slot `capacity + 1` is the trash slot (masked writes land there).
        device: where the ring lives.
        cells: ring cells (default: twice the slots, plus 64 Ki).
    """

    def __init__(self, capacity: int, device: torch.device, *, cells: int | None = None):
        self.capacity = capacity
        self.trash_slot = capacity + 1
        self.cells = 2 * capacity + (1 << 16) if cells is None else cells
        self.ring = torch.full((self.cells + 1,), self.trash_slot, dtype=torch.int32, device=device)
        self.pos = torch.full((capacity + 2,), -1, dtype=torch.int64, device=device)
        self.head = torch.zeros((), dtype=torch.int64, device=device)
        self.tail = torch.zeros((), dtype=torch.int64, device=device)

    def clear(self) -> None:
        self.pos.fill_(-1)
        self.head.zero_()
        self.tail.zero_()

    def push(self, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Append the `slots` `[n]` (int64) whose `keep` `[n]` is set, in order; an earlier
        entry of a pushed slot goes stale."""
        rank = keep.cumsum(0) - 1  # int64: [n] the position among the kept
        at = self.tail + rank
        cell = torch.where(keep, at % self.cells, self.cells)  # the last cell: a trash cell
        self.ring.scatter_(0, cell, slots.int())
        self.pos.scatter_(0, torch.where(keep, slots, self.trash_slot), at)
        self.tail.add_(keep.sum())

    def segment(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `width` entries from the head: positions `[width]` (int64), their slots
        `[width]` (int64) and which are live entries `[width]` (bool). Entries overwritten
        by a full ring are skipped (the head moves past them)."""
        torch.maximum(self.head, self.tail - self.cells, out=self.head)
        at = self.head + torch.arange(width, device=self.head.device)
        slots = self.ring.index_select(0, at % self.cells).long()
        # (the trash slot's `pos` takes the masked writes: never live)
        live = (at < self.tail) & (slots < self.capacity) & (self.pos.index_select(0, slots) == at)
        return at, slots, live

    def advance(self, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """After reading a `segment` of its `slots`: keep the entries `kept` `[width]` (live
        and not taken), moved in order to the segment's end, and move the head past the rest."""
        width = slots.numel()
        count = kept.sum()
        start = self.head + width - count  # the new head
        at = start + kept.cumsum(0) - 1
        cell = torch.where(kept, at % self.cells, self.cells)
        self.ring.scatter_(0, cell, slots.int())
        self.pos.scatter_(0, torch.where(kept, slots, self.trash_slot), at)
        # A segment read past the tail moves the tail to its end (what lies between is stale).
        torch.maximum(self.tail, self.head + width, out=self.tail)
        self.head.copy_(start)

    def forget(self, slots: torch.Tensor) -> None:
        """Make the entries of `slots` `[m]` stale (their rows were evicted)."""
        self.pos.index_fill_(0, slots, -1)
