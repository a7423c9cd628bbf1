"""Hot rows' gradients, summed over the ranks once a step (the update stage of `HotRows`).

Each table's replica gradient is reduced one of two ways (`CacheConfig.hot_reduce`, which
the planner's cost model chooses per table):

    'all'      every row's gradient and a touched flag per row: one all-reduce for all such
               tables of the collection, H·(dim + 1) floats each, whatever the batch touched.
    'touched'  only the rows the rank touched in the step: each rank sends, per table, the
               rows it touched (their gradient, their replica row as an int32 in a float's
               bits beside it) and receives every rank's, one all-gather for all such tables;
               the receiver adds them into their rows. An all-gather takes as much from every
               rank: the most rows any rank touched, a host int per table from a small
               all-reduce (MAX) of the ranks' counts, started in the forward (`expect`) and
               waited for in the backward, long done; a rank that touched fewer pads with the
               sentinel row H, which the sum drops.

The counts are host ints that `HotRows.split` reads with the batch's other counts (its one
read of the device a batch), so the touched rows are chosen by a `nonzero_static` of a size
known on the host: this stage reads nothing back. Either way, each table ends with its
gradient summed over the ranks (`[H, dim]`) and the rows some rank touched (`[H]` bool); the
sums agree to rounding (summed in another order), bitwise for integer-valued gradients.

Example::

    reduction = Reduction([Span(row=0, rows=100, start=0, dim=16, touched_only=True)], group)
    reduction.expect([37])                 # forward: this rank's batch touched 37 of them
    pending = reduction.start(grad, touched)  # backward: collectives started, not waited for
    (summed, used), = reduction.finish(pending)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Span:
    """One table's rows in the collection's flat replica."""

    row: int  # its first row among the replica's rows
    rows: int  # H
    start: int  # where its [H, dim] values begin in the flat replica (and its gradient)
    dim: int
    touched_only: bool  # 'touched': all-gather the touched rows; else all-reduce all H


@dataclass
class Pending:
    """One backward's collectives, in flight."""

    works: list[dist.Work]
    whole: torch.Tensor | None  # 'all' tables: their gradients, then their touched flags
    gathered: torch.Tensor | None  # 'touched' tables: every rank's rows, rank after rank
    caps: list[int]  # rows each rank sent per 'touched' table
    world: int


class Reduction:
    """Sums the replica gradient of a collection's hot tables (`spans`) over `group`'s ranks
    (None: one process)."""

    def __init__(self, spans: list[Span], group: dist.ProcessGroup | None):
        self.spans = spans
        self.whole = [s for s in spans if not s.touched_only]
        self.gathered = [s for s in spans if s.touched_only]
        self.group = group
        self._counts: tuple[dist.Work | None, torch.Tensor] | None = None

    def expect(self, counts: list[int]) -> None:
        """Forward: how many rows of each 'touched' table this rank's batch touched (host
        ints); starts their maximum over the ranks, which `start` waits for."""
        if not self.gathered:
            return
        self._caps()  # a forward without a backward left one in flight
        most = torch.tensor(counts, dtype=torch.int64)
        work = None
        if self.group is not None:
            work = dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._counts = (work, most)

    def start(self, grad: torch.Tensor, touched: torch.Tensor) -> Pending:
        """Backward: start summing `grad` (the flat replica's gradient) over the ranks, with
        `touched` (`[rows]` bool: the replica rows this rank used in the step)."""
        world = dist.get_world_size(self.group) if self.group is not None else 1
        works: list[dist.Work] = []
        whole = None
        if self.whole:
            if len(self.whole) == len(self.spans):
                values, flags = grad, touched
            else:
                values = torch.cat([grad[s.start : s.start + s.rows * s.dim] for s in self.whole])
                flags = torch.cat([touched[s.row : s.row + s.rows] for s in self.whole])
            whole = torch.cat([values, flags.to(values.dtype)])
            if self.group is not None:
                works.append(dist.all_reduce(whole, group=self.group, async_op=True))
        gathered, caps = None, self._caps()
        if self.gathered:
            send = torch.cat(
                [
                    _touched_rows(grad, touched, s, cap)
                    for s, cap in zip(self.gathered, caps, strict=True)
                ]
            )
            gathered = send
            if self.group is not None:
                gathered = send.new_empty(world * send.numel())
                works.append(_ALL_GATHER(gathered, send, group=self.group, async_op=True))
        return Pending(works, whole, gathered, caps, world)

    def finish(self, pending: Pending) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per span, in order: its gradient summed over the ranks `[H, dim]` and the rows some
        rank touched `[H]` (bool)."""
        for work in pending.works:
            work.wait()
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if pending.whole is not None:
            size = sum(s.rows * s.dim for s in self.whole)
            values, flags = pending.whole[:size], pending.whole[size:]
            first = row = 0
            for s in self.whole:
                grad = values[first : first + s.rows * s.dim].view(s.rows, s.dim)
                out[id(s)] = (grad, flags[row : row + s.rows] > 0)
                first, row = first + s.rows * s.dim, row + s.rows
        if pending.gathered is not None:
            per_rank = pending.gathered.view(pending.world, -1)
            first = 0
            for s, cap in zip(self.gathered, pending.caps, strict=True):
                width = cap * (s.dim + 1)
                block = per_rank[:, first : first + width].reshape(-1, s.dim + 1)
                first += width
                at = block[:, 0].contiguous().view(torch.int32).to(torch.int64)
                sums = block.new_zeros(s.rows + 1, s.dim).index_add_(0, at, block[:, 1:])
                used = torch.zeros(s.rows + 1, dtype=torch.bool, device=block.device)
                out[id(s)] = (sums[:-1], used.index_fill_(0, at, True)[:-1])
        return [out[id(s)] for s in self.spans]

    def _caps(self) -> list[int]:
        """The counts `expect` started, reduced (host ints; zeros if none was started)."""
        if self._counts is None:
            return [0] * len(self.gathered)
        work, most = self._counts
        self._counts = None
        if work is not None:
            work.wait()
        return most.tolist()  # a host tensor: no device read


def _touched_rows(grad: torch.Tensor, touched: torch.Tensor, span: Span, cap: int) -> torch.Tensor:
    """`[cap * (dim + 1)]`: each row of `span` this rank touched (at most `cap`), its replica
    row's bits as a float, then its gradient; padded with the sentinel row `span.rows`."""
    mask = touched[span.row : span.row + span.rows]
    at = torch.nonzero_static(mask, size=cap, fill_value=span.rows).squeeze(1)  # [cap]
    rows = grad[span.start : span.start + span.rows * span.dim].view(span.rows, span.dim)
    picked = rows.index_select(0, at.clamp(max=span.rows - 1))  # padding: any row, dropped
    tag = at.to(torch.int32).view(torch.float32).unsqueeze(1)
    return torch.cat([tag, picked], 1).flatten()
