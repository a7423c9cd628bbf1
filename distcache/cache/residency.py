"""`Residency`: which row sits in which cache slot, and which slots are dirty or pinned."""

from __future__ import annotations

import torch


class Residency:
    """The row <-> slot maps of one cache, plus a dirty bit and a pin count per slot.

    Invariants kept by the scheduler that owns it:
    - `slot_of[r] == s` iff `row_of[s] == r`; -1 means "not resident" / "free slot".
    - A pinned slot (`pin > 0`) holds a row used by a batch still in flight; it is never a victim.
    - A dirty slot holds the only up-to-date copy of its row; it is written back before reuse.

    Args:
        num_rows: rows of the shard.
        capacity: cache slots.
        device: where the maps live (the device of the ids the scheduler sees).
    """

    def __init__(self, num_rows: int, capacity: int, device: torch.device):
        self.num_rows = num_rows
        self.capacity = capacity
        self.slot_of = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.pin = torch.zeros(capacity, dtype=torch.int32, device=device)

    def resident_slots(self) -> torch.Tensor:
        """Slots `[n]` that hold a row."""
        return (self.row_of >= 0).nonzero().squeeze(1)

    def dirty_slots(self) -> torch.Tensor:
        """Slots `[n]` whose row must be written back before the slot is reused."""
        return self.dirty.nonzero().squeeze(1)

    def num_resident(self) -> int:
        return int((self.row_of >= 0).sum())

    def num_pinned(self) -> int:
        return int((self.pin > 0).sum())

    def clear(self) -> None:
        """Forget every resident row. The caller must have written dirty rows back."""
        self.slot_of.fill_(-1)
        self.row_of.fill_(-1)
        self.dirty.zero_()
        self.pin.zero_()
