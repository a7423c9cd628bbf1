"""`Window`: the ids of the batches in the look-ahead window, deduplicated, and each row's next use.

A batch of n ids enters the window (`enter`) and gets n consecutive *positions* in a ring. All
shapes are known on the host (no `unique`, no read-back):

- The ids are sorted (a sort's output has the input's shape) and each distinct row is packed to
  the front (`rows`: the batch's distinct rows in ascending order, then the sentinel row, which
  is larger than every row); each id learns its row's index there (`inv`). That is
  `unique(sorted=True, return_inverse=True)` with the padding the host can size. Every later
  pass over a batch touches per-row arrays in ascending address order (faster than random order
  on a CPU: benchmarks/results/README.md, "The engine") and the padding hits one cache line.
  (A cache of every row keeps no next uses, so it deduplicates without a sort, in `latest`:
  `distinct_device`.)
- `latest` `[rows + 2]` int32, per row: the position of the row's latest occurrence in a batch
  that is in the window and not yet staged, or -1. Row k of a batch sits at position `base + k`.
- `next_use` `[ring]` int32, per position: the seq of the next batch that uses the row after this
  occurrence (`NO_USE` while none is known). A batch entering links each of its rows to the row's
  previous occurrence (read from `latest`) in one scatter, and staging a batch reads its own
  slice. Both cost O(n), whatever the window's length L.

Staging a batch (`leave`) resets `latest` for the rows whose latest occurrence it held, so
`latest[r] >= 0` means exactly "r is used by a batch still waiting to be staged". Positions are
reused once their batch has left; the ring grows (keeping positions) when the window holds more
ids than it. Memory: 4 bytes per table row; 21 bytes per id in the window (`rows` int64, `inv`
int32, `valid`, `positions` int32, the ring).

The host places batches in the ring (`reserve`) and numbers them; the device work reads the seq
and the base from a small device tensor (`WindowBatch.at`), never from a Python number, so the
ops a batch dispatches, and every argument they take, are the same for every batch of its size:
what lets CUDA graphs replay them (`tests/unit/cache/test_replay.py` checks it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from distcache.cache.residency import NO_USE
from distcache.cache.select import pack
from distcache.cache.streams import HostCopy
from distcache.errors import LookaheadWindowError

# torch's CPU sort of an integer tensor is a radix sort from 32,768 elements (ATen's grain
# size) and a comparison sort below, several times slower per element from a few thousand ids
# (benchmarks/results/README.md, "The engine"). So batches in between are padded to it. On
# CUDA the padding costs one small copy.
_RADIX_FROM = 32_768
_PAD_FROM = 8_192


@dataclass(eq=False)
class WindowBatch:
    """One batch in the window: its distinct rows and where they sit in the ring."""

    seq: int
    base: int  # position of rows[0]; rows[k] sits at base + k
    at: torch.Tensor  # [2] int32 on the device: seq, base (what the device work reads)
    rows: torch.Tensor  # [n] int64 the distinct rows (ascending), then sentinel rows
    # (a cache of every row: in place, not packed: `Window.distinct_device`)
    inv: torch.Tensor  # [n] int32 index in `rows` of each id's row
    valid: torch.Tensor  # [n] bool rows[k] is a real row (not padding, not the sentinel)
    positions: torch.Tensor  # [n] int32 base + k: where rows[k] sits in the ring
    num_ids: int  # the batch's ids before padding (n when not padded): inv[:num_ids] are theirs
    # How many of `rows` are distinct (`Window.enter_device`), on its way to the host; None
    # where it is never read (`Scheduler.enqueue`).
    distinct: HostCopy | None = None

    @property
    def size(self) -> int:
        return self.rows.numel()

    @property
    def ids(self) -> torch.Tensor:
        """`[num_ids]` the batch's ids (rebuilt: for tests and tools, not the per-batch path)."""
        return self.rows[self.inv[: self.num_ids]]


class Window:
    """Positions, deduplication and next uses of the batches in one cache's look-ahead window.

    Args:
        num_rows: rows of the shard; `latest` has two more entries, for the sentinel row
            (`num_rows`) and a trash row (`num_rows + 1`) that masked scatters write to.
        device: where the arrays live.
    """

    def __init__(self, num_rows: int, device: torch.device):
        self.device = device
        self.sentinel_row, self.trash_row = num_rows, num_rows + 1
        self.latest = torch.full((num_rows + 2,), -1, dtype=torch.int32, device=device)
        self.next_use = torch.full((1024,), NO_USE, dtype=torch.int32, device=device)
        self._pad: torch.Tensor | None = None  # trash rows that pad a sort (`sort`)
        self._live: deque[WindowBatch] = deque()  # entered and not yet left, oldest first
        self._tail = 0  # end of the newest batch's positions
        self.generation = 0  # bumped when `next_use` is replaced (graphs captured it)

    def enter(
        self,
        seq: int,
        base: int,
        at: torch.Tensor,
        device_work: tuple[torch.Tensor, ...],
        num_ids: int,
        distinct: HostCopy | None = None,
    ) -> WindowBatch:
        """Add batch `seq` at the positions from `base` (`reserve(n)`): `at` `[2]` int32 seq and
        base on the device, its `enter_device(ids, at)[:4]`, its id count before padding, and
        the host copy of its distinct count (`WindowBatch.distinct`)."""
        rows, inv, valid, positions = device_work
        batch = WindowBatch(
            seq=seq, base=base, at=at, rows=rows, inv=inv, valid=valid, positions=positions,
            num_ids=num_ids, distinct=distinct,
        )  # fmt: skip
        self._live.append(batch)
        return batch

    def enter_device(self, ids: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The device work of a batch's entry, ids `[n]` (int64, in range or the sentinel row):
        its `rows`, `inv`, `valid`, `positions` (`WindowBatch`), `fresh` `[n]` bool, its rows
        with no occurrence in a batch still waiting to be staged (this batch is their next
        use), and `distinct` `[1]` int32, how many of `rows` are distinct (the sentinel row
        included, if the batch has padding): the rest is sentinel rows. Reads the seq and base
        from `at` only (a graph replays it)."""
        rows, inv, valid, pos, distinct = self._distinct_sorted(ids, at)
        n = ids.numel()
        prev = self.latest.index_select(0, rows)  # [n] latest live position, or -1
        fresh = valid & (prev < 0)
        # The previous occurrence learns that this batch uses its row next. (The sentinel
        # row's `latest` stays -1: it is never written, below.)
        linked = torch.where(prev >= 0, prev.long(), self.ring_size)
        self.next_use.scatter_(0, linked, at[0].expand(n))  # (the trash entry: any of them)
        # Row k of the batch sits at position base + k from now on.
        self.next_use.index_fill_(0, pos.long(), NO_USE)
        self.latest.scatter_(0, torch.where(valid, rows, self.trash_row), pos)
        return rows, inv, valid, pos, fresh, distinct

    def _distinct_sorted(self, ids: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`enter_device`'s deduplication: the batch's `rows` (ascending, packed), `inv`,
        `valid`, `positions` and `distinct`."""
        n = ids.numel()
        # Rows fit int32 (`Residency`), which sorts faster than int64 (1.6 x at 200k ids, CPU).
        ordered, order = self.sort(ids.to(torch.int32))  # [n]
        first = torch.ones(n, dtype=torch.bool, device=self.device)
        first[1:] = ordered[1:] != ordered[:-1]  # the first id of each distinct row
        rank = first.cumsum(0, dtype=torch.int32) - 1  # [n] each sorted id's row among the distinct
        rows = pack(first, rank, ordered, n, self.sentinel_row).long()  # ascending, then sentinels
        inv = torch.empty_like(rank).scatter_(0, order, rank)  # [n] back to input order
        valid = rows != self.sentinel_row
        pos = torch.arange(n, dtype=torch.int32, device=self.device).add_(at[1])
        return rows, inv, valid, pos, rank[-1:] + 1 if n else rank.new_zeros(1)

    def distinct_device(
        self, ids: torch.Tensor, at: torch.Tensor, real: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """A batch's `rows`, `inv`, `valid` and `positions` for a cache of every row
        (`Scheduler._stage_whole`), which links no next uses and so leaves `latest` free to
        deduplicate without sorting, in O(n): each id writes its position into its row's entry,
        and the last occurrence, whose position stays there, represents the row. `rows[k]` is
        then the row of id k where id k represents it, else the sentinel row (not packed: a cache of
        every row moves no rows, and its slots are its rows), and `inv[k]` is the position of
        id k's representative (so `rows[inv]` is the ids). Its batches need no `leave_device`.
        `real` `[n]`: which ids are not the sentinel row (the caller counts them too).
        """
        n = ids.numel()
        here = torch.arange(n, dtype=torch.int32, device=self.device)
        # The last occurrence of each row wins its entry: a max, so the same one on every
        # device (a plain scatter's winner among duplicates is unspecified on CUDA), the one a
        # sequential scatter and the C kernel (`dc_distinct`) keep.
        self.latest.scatter_reduce_(0, ids, here, reduce="amax", include_self=False)
        rep = self.latest.index_select(0, ids)  # [n] each id's representative
        valid = (rep == here) & real
        rows = torch.where(valid, ids, self.sentinel_row)
        return rows, rep, valid, here.add_(at[1])

    def sort(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`torch.sort` of `[n]` int32 ids; batches of `_PAD_FROM` to `_RADIX_FROM` ids are
        sorted padded to `_RADIX_FROM` with the trash row, which sorts after every id, so the
        first n entries are the batch's."""
        n = ids.numel()
        if not _PAD_FROM <= n < _RADIX_FROM:
            return torch.sort(ids)
        if self._pad is None:
            self._pad = ids.new_full((_RADIX_FROM,), self.trash_row)
        ordered, order = torch.sort(torch.cat([ids, self._pad[: _RADIX_FROM - n]]))
        return ordered[:n], order[:n]

    def leave(self, batch: WindowBatch) -> None:
        """Batch `batch` (the oldest) is staged; `leave_device` does its device work."""
        if not self._live or self._live[0] is not batch:
            raise LookaheadWindowError("batches must leave the window in the order they entered")
        self._live.popleft()
        if not self._live:
            self._tail = 0

    def leave_device(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A staged batch's device work (its `rows` and `positions`): returns `[n]` int32 the
        next use of each of its occurrences (`NO_USE` if none in the window), and forgets its
        positions."""
        next_use = self.next_use.index_select(0, positions)
        last_here = self.latest.index_select(0, rows) == positions  # none later (sentinel: -1)
        self.latest.index_fill_(0, torch.where(last_here, rows, self.trash_row), -1)
        return next_use

    def clear(self) -> None:
        self.latest.fill_(-1)
        self.next_use.fill_(NO_USE)
        self._live.clear()
        self._tail = 0

    @property
    def ring_size(self) -> int:
        """Positions in the ring; `next_use[ring_size]`, one past them, is the trash entry."""
        return self.next_use.numel() - 1

    def reserve(self, n: int) -> int:
        """Host-side: the base of n free consecutive positions for the next batch (batches
        leave in FIFO order; `enter` takes the base, on the device, in `at`)."""
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
        self.generation += 1


def check_room(name: str, in_window: int, lookahead: int) -> None:
    """Raise `LookaheadWindowError` if a window of `lookahead` holding `in_window` batches
    (enqueued, not released) cannot take one more (`Scheduler.check_room`, and the engine's
    from its own counts while a scheduler thread runs)."""
    if in_window > lookahead:
        raise LookaheadWindowError(
            f"{name}: look-ahead window full: {in_window} batches are enqueued and not "
            f"released, and lookahead={lookahead} allows {lookahead + 1} "
            "(the training batch plus L future ones)"
        )
