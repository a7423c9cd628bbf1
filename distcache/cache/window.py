"""`Window`: the ids of the batches in the look-ahead window, deduplicated, and each row's next use.

A batch of n ids enters the window (`enter`) and gets n consecutive *positions* in a ring, one
per id. Two arrays do all the work, with shapes the host knows (no `unique`, no sort, no
read-back):

- `latest` `[rows + 2]` int32, per row: the position of the row's latest occurrence in a batch
  that is in the window and not yet staged, or -1. Entering a batch scatters its positions there
  with `amin`, so every id reads back the position of its row's *first* occurrence in the batch:
  the id at that position is the row's representative (`rep`), and the others point at it
  (`inv`). That is `unique(return_inverse=True)` in three O(n) passes, in input order.
- `next_use` `[ring]` int32, per position: the seq of the next batch that uses the row after this
  occurrence (`NO_USE` while none is known). A batch entering links each of its rows to the row's
  previous occurrence (read from `latest` before the scatter) in one scatter, and staging a batch
  reads its own slice. Both cost O(n), whatever the window's length L.

Staging a batch (`leave`) resets `latest` for the rows whose latest occurrence it held, so
`latest[r] >= 0` means exactly "r is used by a batch still waiting to be staged". Positions are
reused once their batch has left; the ring grows (keeping positions) when the window holds more
ids than it. Memory: 4 bytes per table row, 4 bytes per id in the window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

NO_USE = torch.iinfo(torch.int32).max  # next_use of an occurrence whose row is not used again yet


@dataclass(eq=False)
class WindowBatch:
    """One batch in the window: its ids and where they sit in the ring."""

    seq: int
    base: int  # position of ids[0]; ids[i] sits at base + i
    ids: torch.Tensor  # [n] int64 rows (invalid ids already redirected to the sentinel row)
    rep: torch.Tensor  # [n] bool: the first occurrence of its row in the batch
    inv: torch.Tensor  # [n] int64 index of the id's representative (inv[i] == i iff rep[i])

    @property
    def size(self) -> int:
        return self.ids.numel()


class Window:
    """Positions, deduplication and next uses of the batches in one cache's look-ahead window.

    Args:
        num_rows: rows of the shard; `latest` has two more entries, for the sentinel row
            (`num_rows`) and a trash row (`num_rows + 1`) that masked scatters write to.
        device: where the arrays live.
    """

    def __init__(self, num_rows: int, device: torch.device):
        self.device = device
        self.trash_row = num_rows + 1
        self.latest = torch.full((num_rows + 2,), -1, dtype=torch.int32, device=device)
        self.next_use = torch.full((1024,), NO_USE, dtype=torch.int32, device=device)
        self._live: deque[WindowBatch] = deque()  # entered and not yet left, oldest first
        self._tail = 0  # end of the newest batch's positions

    def __len__(self) -> int:
        return len(self._live)

    def enter(self, seq: int, ids: torch.Tensor) -> tuple[WindowBatch, torch.Tensor]:
        """Add batch `seq` with ids `[n]` (int64, in range); returns it and `fresh` `[n]` bool:
        representatives whose row has no occurrence in a batch still waiting to be staged
        (this batch is their next use)."""
        n = ids.numel()
        base = self._alloc(n)
        idx = torch.arange(n, device=self.device)
        pos = (idx + base).to(torch.int32)
        prev = self.latest[ids]  # [n] latest live occurrence before this batch, or -1
        self.latest.scatter_reduce_(0, ids, pos, reduce="amin", include_self=False)
        first = self.latest[ids].long() - base  # [n] index of the row's first occurrence here
        rep = first == idx
        linked = rep & (prev >= 0)
        # The previous occurrence learns that this batch uses its row next.
        self.next_use.index_fill_(0, torch.where(linked, prev.long(), self._trash), seq)
        self.next_use[base : base + n] = NO_USE
        batch = WindowBatch(seq=seq, base=base, ids=ids, rep=rep, inv=first)
        self._live.append(batch)
        return batch, rep & (prev < 0)

    def leave(self, batch: WindowBatch) -> torch.Tensor:
        """Batch `batch` (the oldest) is staged: returns `[n]` int32 the next use of each of its
        occurrences (`NO_USE` if none in the window), and forgets its positions."""
        if not self._live or self._live[0] is not batch:
            raise AssertionError("batches must leave the window in the order they entered")
        self._live.popleft()
        n = batch.size
        next_use = self.next_use[batch.base : batch.base + n].clone()
        pos = torch.arange(batch.base, batch.base + n, dtype=torch.int32, device=self.device)
        last_here = batch.rep & (self.latest[batch.ids] == pos)  # no later occurrence
        self.latest.index_fill_(0, torch.where(last_here, batch.ids, self.trash_row), -1)
        if not self._live:
            self._tail = 0
        return next_use

    def clear(self) -> None:
        self.latest.fill_(-1)
        self.next_use.fill_(NO_USE)
        self._live.clear()
        self._tail = 0

    @property
    def ring_size(self) -> int:
        return self.next_use.numel() - 1  # the last entry is the trash position

    @property
    def _trash(self) -> int:
        return self.next_use.numel() - 1

    def _alloc(self, n: int) -> int:
        """Host-side: the base of n free consecutive positions (batches leave in FIFO order)."""
        size = self.ring_size
        if not self._live:
            base = 0
        else:
            head = self._live[0].base
            limit = head if head >= self._tail else size  # positions above tail are free to it
            if self._tail + n <= limit:
                base = self._tail
            elif all(b.base >= n or b.size == 0 for b in self._live):  # wrap (once per lap)
                base = 0
            else:
                base = self._tail if head < self._tail else size
        if base + n > size:
            self._grow(base + n)
        self._tail = base + n
        return base

    def _grow(self, needed: int) -> None:
        size = max(2 * self.ring_size, needed, 1024)
        grown = torch.full((size + 1,), NO_USE, dtype=torch.int32, device=self.device)
        grown[: self.ring_size] = self.next_use[: self.ring_size]  # positions keep their meaning
        self.next_use = grown
