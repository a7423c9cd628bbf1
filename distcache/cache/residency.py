"""`Residency`: which row sits in which cache slot, which slots are dirty or pinned, and when the
window next uses each slot's row."""

from __future__ import annotations

import torch

from distcache.errors import DistcacheConfigError

NO_USE = torch.iinfo(torch.int32).max  # the next use of a row no batch in the window uses


class Residency:
    """The row <-> slot maps of one cache, plus a dirty bit, a pin count and the next use of
    its row per slot.

    Two extra rows and slots make every per-batch update a fixed-shape scatter:
    - the *sentinel row* `num_rows` always sits in the *sentinel slot* `capacity`, whose weights
      stay zero: padding and invalid ids map there, so they read zeros and are never loaded;
    - the *trash* row `num_rows + 1` and slot `capacity + 1` absorb the writes of masked-out
      entries (a scatter writes every entry; the ones that should not land go to the trash).

    Invariants kept by the scheduler that owns it:
    - `slot_of[r] == s` iff `row_of[s] == r` for real rows and slots; -1 means "not resident" /
      "free slot".
    - A pinned slot (`pin > 0`) holds a row used by a batch still in flight; it is never a victim.
    - A dirty slot holds the only up-to-date copy of its row; it is written back before reuse.
    - `next_use[s]` is the seq of the first batch in the window, not yet staged, that uses the
      row of slot s, or `NO_USE` (the row's last use in the window has been staged: it is
      *expired*). Set when a batch is staged (for its rows) and when a batch enters the window
      (for the resident rows it is the first to use); meaningless for free slots.

    Device memory per table row: 4 bytes (`slot_of` is int32); per slot 17.

    Args:
        num_rows: rows of the shard (< 2**31 - 2).
        capacity: cache slots.
        device: where the maps live (the device of the ids the scheduler sees).
    """

    def __init__(self, num_rows: int, capacity: int, device: torch.device):
        if num_rows + 2 > torch.iinfo(torch.int32).max:
            raise DistcacheConfigError(
                f"a shard of {num_rows} rows is too large: at most 2**31 - 3 rows"
            )
        self.num_rows = num_rows
        self.capacity = capacity
        self.sentinel_row, self.trash_row = num_rows, num_rows + 1
        self.sentinel_slot, self.trash_slot = capacity, capacity + 1
        self.slot_of = torch.full((num_rows + 2,), -1, dtype=torch.int32, device=device)
        self.row_of = torch.full((capacity + 2,), -1, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(capacity + 2, dtype=torch.bool, device=device)
        self.pin = torch.zeros(capacity + 2, dtype=torch.int32, device=device)
        self.next_use = torch.full((capacity + 2,), NO_USE, dtype=torch.int32, device=device)
        self._pair_sentinels()

    def _pair_sentinels(self) -> None:
        self.slot_of[self.sentinel_row] = self.sentinel_slot
        self.row_of[self.sentinel_slot] = self.sentinel_row

    # Whole-cache queries: host reads, for flush, checkpoints and tests (not the per-batch path).
    def resident_slots(self) -> torch.Tensor:
        """Slots `[n]` that hold a row."""
        return (self.row_of[: self.capacity] >= 0).nonzero().squeeze(1)

    def dirty_slots(self) -> torch.Tensor:
        """Slots `[n]` whose row must be written back before the slot is reused."""
        return self.dirty[: self.capacity].nonzero().squeeze(1)

    def num_resident(self) -> int:
        return int((self.row_of[: self.capacity] >= 0).sum())

    def num_pinned(self) -> int:
        return int((self.pin[: self.capacity] > 0).sum())

    def clear(self) -> None:
        """Forget every resident row. The caller must have written dirty rows back."""
        self.slot_of.fill_(-1)
        self.row_of.fill_(-1)
        self.dirty.zero_()
        self.pin.zero_()
        self.next_use.fill_(NO_USE)
        self._pair_sentinels()

    def unpin_all(self) -> None:
        """Release every pin (the batches in flight were dropped); rows stay resident."""
        self.pin.zero_()
