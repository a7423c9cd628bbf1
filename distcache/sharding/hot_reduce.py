"""Hot rows' gradients, summed over the ranks once a step, and applied (the update stage of
`HotRows`: `Reduction`, then `apply_whole` or `apply_touched` per table).

The backward hands in each hot id's gradient row, per embedding dim (a width of the replica:
`HotRows.widths`), as `(width, replica rows [h], gradient rows [h, dim])`. Each table's part
is reduced one of two ways (`CacheConfig.hot_reduce`, which the planner's cost model chooses
per table):

    'all'      added up into every row of the table with a touched flag per row, and
               all-reduced: one all-reduce for all such tables of the collection, H·(dim + 1)
               floats each, whatever the batch touched.
    'touched'  summed per row on the rank (a sort of the rows, a sum per run), then only the
               rows the rank touched are sent (their sums, their row as an int32 in a float's
               bits beside them): one all-gather for all such tables; the receiver sums the
               ranks' rows per row again. An all-gather takes as much from every rank: per
               table the most rows any rank touched, host ints from a small all-reduce (MAX)
               of the ranks' counts, started in the forward (`expect`) and waited for in the
               backward, long done; a rank that touched fewer pads with a sentinel row (the
               width's row count), which every update drops. Nothing of size H is made.

The counts are host ints that `HotRows.split` reads with the batch's other counts (its one
read of the device a batch); every other size here is known on the host. The counts' maximum
goes over a gloo group (`host_group`: host ints); the gradients go over `group`, which
`HotRows` gives the default process group's backend: NCCL between GPUs, which reduces and
gathers device tensors with no read of the device; gloo on CPU. On a gloo group with CUDA
tensors (a job run on gloo) the rows to all-gather are copied to the host first (gloo gathers
host tensors only), one read of the device a step, in the backward. Either way the sums agree
to rounding (summed in another order), bitwise for integer-valued gradients.

Example::

    reduction = Reduction([Span("t", width=0, row=0, rows=100, dim=16, touched_only=True)],
                          width_rows=[100], group=group)
    reduction.expect([37])                               # forward: 37 rows of t touched here
    pending = reduction.start([(0, rows, grads)])        # backward: collectives started
    reduced = reduction.finish(pending)                  # reduced.rows[0]: (rows, sums)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distcache.cache.optimizers import RowOptimizer

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Gathering(threading.local):
    active = False


_GATHERING = _Gathering()


def in_hot_gather() -> bool:
    """Whether this thread is issuing a replica's all-gather (for counting collectives apart
    from the all-to-alls: `tools.collectives.CollectiveBytes`)."""
    return _GATHERING.active


Entry = tuple[int, torch.Tensor, torch.Tensor]
"""(width, replica rows of the width `[h]`, their gradient rows `[h, dim]`)."""


@dataclass(frozen=True)
class Span:
    """One table's rows in the replica."""

    name: str
    width: int  # the index of its width (`HotRows.widths`)
    row: int  # its first row among its width's rows
    rows: int  # H
    dim: int
    touched_only: bool  # 'touched': all-gather the touched rows; else all-reduce all H


@dataclass
class Pending:
    """One backward's collectives, in flight."""

    works: list[dist.Work]
    whole: torch.Tensor | None  # 'all' tables: their rows' sums, then their touched flags
    gathered: torch.Tensor | None  # 'touched' tables: every rank's rows, rank after rank
    caps: dict[int, int]  # rows each rank sent per width of 'touched' tables
    world: int


@dataclass
class Reduced:
    """A step's gradients, summed over the ranks (not divided by their number)."""

    whole: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Per 'all' table: its gradient `[H, dim]` and the rows some rank touched `[H]` (bool)."""
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]]
    """Per width of 'touched' tables: rows of the width `[n]` (each once; the sentinel, the
    width's row count, for none) and their gradients `[n, dim]`."""


def reduction_groups() -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """The replicas' groups of every rank (None in one process): gloo for host numbers (counts,
    learning rates), and one of the default backend for rows and gradients (NCCL between GPUs:
    no copy through the host; the gloo group itself where that is gloo)."""
    if not dist.is_initialized():
        return None, None
    host = dist.new_group(backend="gloo")
    backend = dist.get_backend()
    return host, host if backend == "gloo" else dist.new_group(backend=backend)


class Reduction:
    """Sums the replica gradients of a collection's hot tables (`spans`; `width_rows`: each
    width's rows) over `group`'s ranks (None: one process); the replica is on `device`.
    `host_group`: a gloo group of the same ranks for the host ints (default: `group`)."""

    def __init__(
        self,
        spans: list[Span],
        width_rows: list[int],
        group: dist.ProcessGroup | None,
        device: torch.device | None = None,
        host_group: dist.ProcessGroup | None = None,
    ):
        self.spans = sorted(spans, key=lambda s: (s.width, s.row))
        self.whole = [s for s in self.spans if not s.touched_only]
        self.gathered = [s for s in self.spans if s.touched_only]
        self.width_rows = width_rows
        self.group = group
        self.host_group = host_group or group
        self.device = device or torch.device("cpu")
        # gloo gathers host tensors only (it reduces device ones through the host itself).
        self._gather_on_host = group is not None and dist.get_backend(group) == "gloo"
        self._counts: tuple[dist.Work | None, torch.Tensor] | None = None
        self._dims = {s.width: s.dim for s in self.spans}  # each width's embedding dim
        # Per width: each row's place among its 'all' tables' rows (their count for others),
        # with that count, and its key among the 'touched' tables' rows (itself; the width's
        # rows for others).
        self._all_row: dict[int, tuple[torch.Tensor, int]] = {}
        self._key: dict[int, torch.Tensor] = {}
        for width, rows in enumerate(width_rows):
            mine = [s for s in self.spans if s.width == width]
            whole = [s for s in mine if not s.touched_only]
            if whole:
                count = sum(s.rows for s in whole)
                place = torch.full((rows,), count, dtype=torch.int64)
                first = 0
                for s in whole:
                    place[s.row : s.row + s.rows] = torch.arange(first, first + s.rows)
                    first += s.rows
                self._all_row[width] = (place.to(self.device), count)
            if any(s.touched_only for s in mine):
                key = torch.full((rows,), rows, dtype=torch.int64)
                for s in mine:
                    if s.touched_only:
                        key[s.row : s.row + s.rows] = torch.arange(s.row, s.row + s.rows)
                self._key[width] = key.to(self.device)

    def expect(self, counts: list[int]) -> None:
        """Forward: how many rows of each 'touched' table (`gathered`, in order) this rank's
        batch touched (host ints); starts their maximum over the ranks, which `start` reads."""
        if not self.gathered:
            return
        self._caps()  # a forward without a backward left one in flight
        most = torch.tensor(counts, dtype=torch.int64)
        work = None
        if self.host_group is not None:
            work = dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True)
        self._counts = (work, most)

    def start(self, entries: list[Entry]) -> Pending:
        """Backward: start summing the step's gradient rows (`entries`) over the ranks."""
        world = dist.get_world_size(self.group) if self.group is not None else 1
        per_width = self._by_width(entries)
        works: list[dist.Work] = []
        whole = None
        if self.whole:
            sums, flags = [], []
            for width, (place, count) in self._all_row.items():
                rows, grads = per_width[width]
                at = place.index_select(0, rows)
                buf = grads.new_zeros(count + 1, grads.shape[1]).index_add_(0, at, grads)
                flag = grads.new_zeros(count + 1).index_fill_(0, at, 1.0)
                sums.append(buf[:-1].flatten())
                flags.append(flag[:-1])
            whole = torch.cat(sums + flags)
            if self.group is not None:
                works.append(dist.all_reduce(whole, group=self.group, async_op=True))
        gathered, caps = None, self._width_caps()
        if self.gathered:
            blocks = []
            for width, key in self._key.items():
                rows, grads = per_width[width]
                keys, sums = sum_by_key(key.index_select(0, rows), grads, self.width_rows[width])
                blocks.append(_packed(keys, sums, caps[width], self.width_rows[width]))
            gathered = send = torch.cat(blocks)
            if self.group is not None:
                if self._gather_on_host:
                    send = send.cpu()  # (a no-op on CPU)
                gathered = send.new_empty(world * send.numel())
                _GATHERING.active = True
                try:
                    works.append(_ALL_GATHER(gathered, send, group=self.group, async_op=True))
                finally:
                    _GATHERING.active = False
        return Pending(works, whole, gathered, caps, world)

    def finish(self, pending: Pending) -> Reduced:
        """Wait for `pending` and sum what the ranks sent."""
        for work in pending.works:
            work.wait()
        whole: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if pending.whole is not None:
            size = sum(s.rows * s.dim for s in self.whole)
            values, flags = pending.whole[:size], pending.whole[size:]
            first = row = 0
            for s in self.whole:
                grad = values[first : first + s.rows * s.dim].view(s.rows, s.dim)
                whole[s.name] = (grad, flags[row : row + s.rows] > 0)
                first, row = first + s.rows * s.dim, row + s.rows
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if pending.gathered is not None:
            per_rank = pending.gathered.to(self.device).view(pending.world, -1)
            first = 0
            for width in self._key:
                dim, cap = self._dims[width], pending.caps[width]
                block = per_rank[:, first : first + cap * (dim + 1)].reshape(-1, dim + 1)
                first += cap * (dim + 1)
                keys = block[:, 0].contiguous().view(torch.int32).to(torch.int64)
                rows[width] = sum_by_key(keys, block[:, 1:], self.width_rows[width])
        return Reduced(whole, rows)

    def _by_width(self, entries: list[Entry]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per width: its entries' rows and gradient rows, concatenated."""
        out = []
        for width in range(len(self.width_rows)):
            mine = [(rows, grads) for w, rows, grads in entries if w == width]
            if len(mine) == 1:
                out.append(mine[0])
            elif mine:
                out.append((torch.cat([r for r, _ in mine]), torch.cat([g for _, g in mine])))
            else:  # no hot id of this width reached the backward
                empty = torch.zeros(0, dtype=torch.int64, device=self.device)
                out.append((empty, torch.zeros(0, self._dims[width], device=self.device)))
        return out

    def _width_caps(self) -> dict[int, int]:
        """Rows each rank sends per width of 'touched' tables: the sum of its tables' most
        touched rows on any rank (host ints)."""
        caps = dict.fromkeys(self._key, 0)
        for span, most in zip(self.gathered, self._caps(), strict=True):
            caps[span.width] += most
        return caps

    def _caps(self) -> list[int]:
        """The counts `expect` started, reduced (host ints; zeros if none was started)."""
        if self._counts is None:
            return [0] * len(self.gathered)
        work, most = self._counts
        self._counts = None
        if work is not None:
            work.wait()
        return most.tolist()  # a host tensor: no device read


def sum_by_key(
    keys: torch.Tensor, values: torch.Tensor, sentinel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys` `[n]` (ints <= `sentinel`) and `values` `[n, d]` summed per key: `[n]` the keys,
    ascending, each once, then `sentinel`; `[n, d]` their sums (zeros after the last). One
    stable sort of the keys and a sum per run of equal keys; every size is `n`."""
    n = keys.numel()
    ordered, order = torch.sort(keys, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=keys.device)
    first[1:] = ordered[1:] != ordered[:-1]
    run = torch.cumsum(first, 0) - 1  # each entry's run
    unique = torch.full_like(keys, sentinel).scatter_(0, run, ordered)
    # Each value added into its run where it stands, not reordered first (a key's values are
    # added in their order either way).
    slot = torch.empty_like(run).scatter_(0, order, run)
    sums = values.new_zeros(n, values.shape[1]).index_add_(0, slot, values)
    return unique, sums


def _packed(keys: torch.Tensor, sums: torch.Tensor, cap: int, sentinel: int) -> torch.Tensor:
    """`[cap * (dim + 1)]`: the first `cap` keys (as an int32's bits) and sums, padded with
    the sentinel: a rank's distinct keys are at most `cap` (the most any rank touched), and
    they come first."""
    n = keys.numel()
    if n < cap:
        keys = torch.cat([keys, keys.new_full((cap - n,), sentinel)])
        sums = torch.cat([sums, sums.new_zeros(cap - n, sums.shape[1])])
    tag = keys[:cap].to(torch.int32).view(torch.float32).unsqueeze(1)
    return torch.cat([tag, sums[:cap]], 1).flatten()


# ---------------------------------------------------------------------------------- the update
def apply_whole(
    optimizer: RowOptimizer,
    weight: torch.Tensor,
    state: torch.Tensor,
    grad: torch.Tensor,
    used: torch.Tensor,
) -> None:
    """An 'all' table's update, in place: every row `weight` `[H, dim]` (and `state`) with its
    gradient `grad` (zero where no rank touched it, `used` `[H]` False), directly where a zero
    gradient leaves a row as it is (SGD, Adagrad); else (Adam) on a copy, of which only the
    touched rows are kept."""
    if optimizer.zero_gradient_keeps_rows:
        optimizer.update(weight, state, grad)
        return
    used = used.unsqueeze(1)
    rows, new_state = weight.clone(), state.clone()
    optimizer.update(rows, new_state, grad)
    weight.copy_(torch.where(used, rows, weight))
    state.copy_(torch.where(used, new_state, state))


def apply_touched(
    view: torch.Tensor,
    state: torch.Tensor,
    keys: torch.Tensor,
    grad: torch.Tensor,
    tables: list[tuple[RowOptimizer, int, int, int]],
) -> None:
    """One width's 'touched' tables' update, of the rows some rank touched only: those rows
    (`keys` `[n]` of the width's `view` `[rows + 1, dim]`, each once, the sentinel `rows` for
    none) and their `state` (`[rows + 1, columns]`) gathered, updated with `grad` `[n, dim]`,
    written back. `tables`: (optimizer, first row, rows, state columns) of each. One update
    for all where their optimizers are alike (the usual case), else one per table; the rows of
    the width's other tables, and the sentinel, go to the scratch row (the last), which
    nothing reads."""
    alike = len({_optimizer_key(optimizer) for optimizer, *_ in tables}) == 1
    scratch = view.shape[0] - 1
    for optimizer, first, count, columns in tables[:1] if alike else tables:
        at = keys  # every key is a row of one of `tables` (or the sentinel)
        if not alike:
            at = torch.where((keys >= first) & (keys < first + count), keys, scratch)
        rows, rows_state = view.index_select(0, at), state.index_select(0, at)
        optimizer.update(rows, rows_state[:, :columns], grad)
        view.index_copy_(0, at, rows)
        state.index_copy_(0, at, rows_state)


def _optimizer_key(optimizer: RowOptimizer) -> tuple:
    """Equal for optimizers that update a row alike (kind, rates, step count)."""
    return (type(optimizer), tuple(sorted(vars(optimizer).items())))
