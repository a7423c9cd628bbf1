"""Hot rows: some rows of a sharded table replicated on every rank.

A table's `CacheConfig.hot_rows` names rows (its hottest, typically) that every rank holds in a
local replica. One batch's ids flow so:

    input_dist   `HotRows.split`: each id of a hot table is looked up among its hot rows; hot
                 ids are taken out of the features before TorchRec routes them (they cross no
                 all-to-all and take no cache slot), the rest go through the table's sharding
    compute      `HotRows.pooled`: the hot ids' rows pooled from the replica on this rank,
                 `[B, dim]` per feature, each id scaled by its weight for weighted features:
                 one embedding bag per embedding dim over every feature's bags
    output       `HotRows.combine`: added to the sharded (cold) part of the output; a mean bag
                 becomes (cold mean * cold ids + hot sum) / all ids, as pooling all its ids.
                 Per-id outputs (`EmbeddingCollection`, `sequence=True`): `HotRows.rows` are
                 the hot ids' replica rows, and `HotRows.combine_sequence` puts them back
                 among the sharded ids' rows, each id in its place
    backward     the replicas' gradient (every hot table's, one flat tensor) is summed over
                 the ranks (divided by the world size, TorchRec's convention for embedding
                 gradients), whole or only the rows each rank touched, per table's
                 `CacheConfig.hot_reduce` (`sharding.hot_reduce`), started when the gradient
                 is ready and waited for when the replica is next read (the next forward, a
                 flush), then applied by each table's row optimizer to the rows some rank
                 touched; untouched rows (and their optimizer state) are left as they are, as
                 for every row of a sharded table. The learning rate is the one the table's
                 shards used in that backward (which LR schedulers change), taken from the
                 ranks that hold a shard (`lr_sources`) by a small all-reduce beside the
                 gradient's, so every rank's replica takes the same step, a rank without a
                 shard of the table too

The table stays one table for its users: a flush (before any state dict) writes the replica's
rows and optimizer state into the shards that own them; after a load the replica is read back
(one all-reduce, at the next forward). Checkpoints hold plain tables, for any set of hot rows.

Splitting a batch compacts its hot ids and its cold ids: on CUDA that reads their counts back
(one read for the batch, which also counts the rows each 'touched' table's hot ids touch), and
the features' offsets are read as host ints (both as TorchRec's own input distribution does for
its splits); everything else is fixed-shape.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from distcache.cache.config import CacheConfig
from distcache.cache.optimizers import RowOptimizer, make_optimizer
from distcache.cache.streams import DeviceInts
from distcache.constants import HOT_TOUCHED
from distcache.errors import DistcacheConfigError
from distcache.sharding.hot_pool import AddColumns, PlaceRows, PooledRows
from distcache.sharding.hot_reduce import (
    Entry,
    Pending,
    Reduced,
    Reduction,
    Span,
    apply_touched,
    apply_whole,
    reduction_groups,
)


@dataclass
class HotTable:
    """One table's replicated rows."""

    name: str
    dim: int
    ids: torch.Tensor  # [H] int64 global rows, sorted
    start: int  # where its [H, dim] rows begin in the collection's flat replica
    row: int  # its first row among the replica's rows (every table's, in the flat's order)
    width: int  # its width's index
    optimizer: RowOptimizer
    touched_only: bool  # its gradient reduced as the rows each rank touched (`hot_reduce`)
    state: torch.Tensor | None = None  # [H, state_dim] fp32 optimizer state: a view of its width's

    def rows_of(self, flat: torch.Tensor) -> torch.Tensor:
        """Its [H, dim] rows in `flat` (the replica): a view."""
        return flat[self.start : self.start + self.ids.numel() * self.dim].view(-1, self.dim)


@dataclass
class _Width:
    """The hot tables of one embedding dim: their rows side by side in the flat replica, one
    `[rows, dim]` view that one embedding bag pools from, then a scratch row (where a sparse
    update writes what it drops)."""

    dim: int
    start: int  # where its rows begin in the flat replica
    row: int  # its first row among the replica's rows
    rows: int
    # [rows + 1, columns] its tables' optimizer state (each table's columns first), a scratch
    # row last
    state: torch.Tensor | None = None

    def view(self, flat: torch.Tensor, *, scratch: bool = False) -> torch.Tensor:
        end = self.start + (self.rows + scratch) * self.dim
        return flat[self.start : end].view(-1, self.dim)


@dataclass
class _HotIds:
    """The hot ids of one width's tables in a batch, compacted, in bag order."""

    rows: torch.Tensor  # [h] the id's row in the width's view
    weights: torch.Tensor | None  # [h] the id's weight (weighted features), fp32
    offsets: torch.Tensor  # [F * B + 1] where each bag's hot ids begin, and the end
    bags: torch.Tensor  # [h] the id's bag, k * B + b for feature k, sample b
    positions: torch.Tensor | None  # [h] the id's index in the batch's values (sequence only)


@dataclass
class HotInput:
    """One batch's hot part, kept in the context from `split` to `pooled` and `combine`."""

    keys: list[str]
    widths: list[_HotIds]  # per `HotRows.widths`
    hot_per_bag: torch.Tensor  # [F * B] hot ids per bag
    lengths: torch.Tensor  # [F * B] all ids per bag
    stride: int
    key_ends: list[int]  # where each feature's ids end in the batch's values, after a 0
    cold_positions: torch.Tensor | None  # [n - hot] each cold id's index (sequence only)
    touched_counts: list[int]  # rows each 'touched' table's hot ids touch (`Reduction.gathered`)


class HotRows:
    """The hot rows of one sharded collection's tables.

    Args:
        tables: per table with hot rows: (rows, dim, its CacheConfig with `hot_rows`).
        feature_tables: the collection's features, in order, and the table each reads.
        mean_features: features pooled by mean.
        device: where the replicas live.
        sequence: per-id outputs (`EmbeddingCollection`): `rows` and `combine_sequence`
            instead of `pooled` and `combine`.
    """

    def __init__(
        self,
        tables: dict[str, tuple[int, int, CacheConfig]],
        feature_tables: dict[str, str],
        mean_features: set[str],
        device: torch.device,
        *,
        sequence: bool = False,
    ):
        self.sequence = sequence
        self.tables: dict[str, HotTable] = {}
        self.widths: list[_Width] = []
        start = row = 0
        # Tables of one dim side by side (a width), widths one after another.
        for name, (rows, dim, config) in sorted(tables.items(), key=lambda item: item[1][1]):
            bad = [r for r in config.hot_rows if r >= rows]
            if bad:
                raise DistcacheConfigError(
                    f"table {name!r}: hot_rows {bad[:8]} are outside its {rows} rows [0, {rows})"
                )
            if rows >= _TABLE_SPAN:
                raise DistcacheConfigError(
                    f"table {name!r} has {rows} rows; hot rows are kept for tables of fewer "
                    f"than {_TABLE_SPAN} rows"
                )
            ids = torch.tensor(sorted(config.hot_rows), dtype=torch.int64, device=device)
            optimizer = make_optimizer(config)
            if not self.widths or self.widths[-1].dim != dim:
                if self.widths:
                    start += self.widths[-1].dim  # the last width's scratch row
                self.widths.append(_Width(dim, start, row, 0))
            touched = config.hot_reduce == HOT_TOUCHED
            self.tables[name] = HotTable(
                name, dim, ids, start, row, len(self.widths) - 1, optimizer, touched
            )
            self.widths[-1].rows += len(ids)
            start += len(ids) * dim
            row += len(ids)
        start += self.widths[-1].dim if self.widths else 0
        self.num_rows = row
        self._allocate_states(device)
        # Every hot row as one key, table t's row r at t·_TABLE_SPAN + r: sorted, and each
        # key's index is its replica row (tables are numbered in the replica's order), so one
        # binary search finds every feature's hot ids at once.
        self._keys = (
            torch.cat([t.ids + i * _TABLE_SPAN for i, t in enumerate(self.tables.values())])
            if self.tables
            else torch.zeros(0, dtype=torch.int64, device=device)
        )  # [rows]
        self._span = {name: i * _TABLE_SPAN for i, name in enumerate(self.tables)}
        self._no_table = len(self.tables) * _TABLE_SPAN  # features of tables without hot rows
        self._feature_spans: dict[tuple[str, ...], torch.Tensor] = {}
        self._ints = DeviceInts()  # batches' strides per key, on the device
        # Every table's replica in one fp32 tensor (not a Parameter, no gradient: the backward
        # hands its rows' gradients to `_collect`); the trigger's gradient says the backward is
        # done with it (`hot_pool`).
        self.flat = torch.zeros(start, device=device)
        self._trigger = torch.zeros((), device=device, requires_grad=True)
        self._trigger.register_post_accumulate_grad_hook(self._step)
        self._grads: list[Entry] = []
        self.feature_tables = {f: t for f, t in feature_tables.items() if t in self.tables}
        self.mean_features = set(mean_features)
        self.device = device
        self._host_group, self.data_group = reduction_groups()
        spans = [
            Span(n, t.width, t.row - self.widths[t.width].row, t.ids.numel(), t.dim, t.touched_only)
            for n, t in self.tables.items()
        ]
        self._reduction = Reduction(
            spans, [w.rows for w in self.widths], self.data_group, device, self._host_group
        )
        self.stale = True  # the replicas must be read from the tables' shards
        # The last backward's reduction and learning rates' all-reduce, still in flight.
        self._pending: tuple[Pending, dist.Work | None, torch.Tensor] | None = None
        self.reader: Callable[[HotRows], None] | None = None
        # Per table with a shard on this rank: the learning rate its kernel applies in this
        # backward (a host float). A table no rank reports keeps its configured rate.
        self.lr_sources: dict[str, Callable[[], float]] = {}

    def _allocate_states(self, device: torch.device) -> None:
        """The optimizer state, per width as the rows are: one tensor with a scratch row,
        each table's state a view of it (its rows, its optimizer's columns)."""
        for index, width in enumerate(self.widths):
            mine = [t for t in self.tables.values() if t.width == index]
            columns = max(t.optimizer.state_dim(t.dim) for t in mine)
            width.state = torch.zeros(width.rows + 1, columns, device=device)
            for t in mine:
                first = t.row - width.row
                t.state = width.state[first : first + t.ids.numel(), : t.optimizer.state_dim(t.dim)]

    # ------------------------------------------------------------ the batch
    def split(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, HotInput]:
        """The features without their hot ids, and the hot ids, compacted per width.

        Every id is looked up among every table's sorted hot rows at once: one binary search
        of its key (its table's span + the id; `__init__`), whose index is the replica row;
        per-bag counts come from a running sum read at the bags' offsets. Only the
        compactions have a data-dependent size: one host read per width, and one for the cold
        ids."""
        keys = features.keys()
        values, lengths = features.values(), features.lengths()
        weights = features.weights_or_none()
        n, device = values.numel(), values.device
        key_ends = features.offset_per_key()  # host ints, as TorchRec's own routing reads them
        # Each id's index, compacted beside it where outputs are per id.
        index = torch.arange(n, device=device) if self.sequence else None
        # Each id's key: its table's span (per bag, then per id by the bags' lengths) + id.
        # Ids outside [0, _TABLE_SPAN) (invalid ones, which the shards report) match no row.
        span = self._spans(keys, device)  # [F]
        if features.variable_stride_per_key():
            bags = self._ints(features.stride_per_key(), device)
            span = span.repeat_interleave(bags, output_size=lengths.numel())  # [bags]
        else:
            span = span.repeat_interleave(features.stride())  # [F * B]
        queries = values.to(torch.int64).clamp(-1, _TABLE_SPAN - 1)
        queries += span.repeat_interleave(lengths, output_size=n)
        if self.num_rows:
            pos = torch.searchsorted(self._keys, queries).clamp_(max=self.num_rows - 1)
            row = torch.where(self._keys.index_select(0, pos) == queries, pos, -1)
        else:
            row = torch.full_like(queries, -1)  # [n] replica row, -1: cold
        hot = row >= 0
        bag_ends = features.offsets_or_none()  # [F * B + 1]; else no FBGEMM cumsum (CUDA build)
        bag_ends = _running_sum(lengths) if bag_ends is None else bag_ends
        hot_before = _running_sum(hot)  # [n + 1]
        hot_per_bag = hot_before.index_select(0, bag_ends).diff()
        every_bag = torch.arange(hot_per_bag.numel(), device=device)
        masks = [
            hot if len(self.widths) == 1 else (row >= w.row) & (row < w.row + w.rows)
            for w in self.widths
        ]
        # The compactions' sizes and the 'touched' tables' touched rows: one read of the device
        # (see the module docstring).
        sums = [m.sum() for m in masks] + self._touched_rows(row, hot)
        counts = torch.stack(sums).tolist() if sums else []
        counts, touched_counts = counts[: len(masks)], counts[len(masks) :]
        widths = []
        for width, mine, count in zip(self.widths, masks, counts, strict=True):
            before = hot_before if mine is hot else _running_sum(mine)
            local = row - width.row if width.row else row
            rows, kept, at = _compact(mine, before, count, local, weights, index)
            ends = before.index_select(0, bag_ends)
            bags = torch.repeat_interleave(every_bag, ends.diff(), output_size=count)
            kept = None if kept is None else kept.float()
            widths.append(_HotIds(rows=rows, weights=kept, offsets=ends, bags=bags, positions=at))
        cold_before = torch.arange(n + 1, device=device) - hot_before  # cold ids before each
        values_cold, weights_cold, cold_at = _compact(
            ~hot, cold_before, n - sum(counts), values, weights, index
        )
        rest = KeyedJaggedTensor(
            keys=keys,
            values=values_cold,
            lengths=lengths - hot_per_bag.to(lengths.dtype),
            weights=weights_cold,
            stride=features.stride(),
        )
        part = HotInput(
            keys=list(keys),
            widths=widths,
            hot_per_bag=hot_per_bag,
            lengths=lengths,
            stride=features.stride(),
            key_ends=list(key_ends),
            cold_positions=cold_at,
            touched_counts=touched_counts,
        )
        return rest, part

    def _touched_rows(self, row: torch.Tensor, hot: torch.Tensor) -> list[torch.Tensor]:
        """Per 'touched' table (`Reduction.gathered`): how many of its rows the batch's ids
        (`row`: each id's replica row, `hot`: whether it has one) touch, on the device."""
        if not self._reduction.gathered:
            return []
        touched = torch.zeros(self.num_rows + 1, dtype=torch.bool, device=row.device)
        touched.index_fill_(0, torch.where(hot, row, self.num_rows), True)
        return [
            touched[self.tables[s.name].row : self.tables[s.name].row + s.rows].sum()
            for s in self._reduction.gathered
        ]

    def _spans(self, keys: list[str], device: torch.device) -> torch.Tensor:
        """`[F]` each feature's span in the keys of `_keys` (beyond them for a feature of a
        table without hot rows), kept per order of the features."""
        order = tuple(keys)
        spans = self._feature_spans.get(order)
        if spans is None:
            tables = [self.feature_tables.get(key) for key in keys]
            spans = torch.tensor([self._span.get(t, self._no_table) for t in tables], device=device)
            self._feature_spans[order] = spans
        return spans

    def pooled(self, part: HotInput) -> dict[str, torch.Tensor]:
        """Per hot feature, the sum of its hot ids' rows per bag `[B, dim]` (weighted): one
        embedding bag per width over the replica's rows, every feature's bags at once."""
        self._ready(part)
        out: dict[str, torch.Tensor] = {}
        for index, (width, ids) in enumerate(zip(self.widths, part.widths, strict=True)):
            sums = PooledRows.apply(
                self._trigger,
                width.view(self.flat),
                ids.rows,
                ids.offsets,
                ids.weights,
                ids.bags,
                functools.partial(self._collect, index, ids.rows),
            )  # [F * B, dim]
            # One split, not a slice per feature: a slice's backward fills a zero gradient of
            # all of `sums` and adds into it (8 MB a feature at B = 2048, dim = 128); the
            # split's concatenates the features' gradients once.
            for key, bags in zip(part.keys, sums.split(part.stride), strict=True):
                name = self.feature_tables.get(key)
                if name is not None and self.tables[name].dim == width.dim:
                    out[key] = bags
        return out

    def rows(self, part: HotInput) -> list[torch.Tensor]:
        """Per width, the replica row of each of its hot ids `[h, dim]`, in the batch's order
        (per-id outputs)."""
        self._ready(part)
        out = []
        for index, (width, ids) in enumerate(zip(self.widths, part.widths, strict=True)):
            each = torch.arange(ids.rows.numel() + 1, device=self.device)  # a bag per id
            sink = functools.partial(self._collect, index, ids.rows)
            view = width.view(self.flat)
            out.append(PooledRows.apply(self._trigger, view, ids.rows, each, None, None, sink))
        return out

    def combine_sequence(
        self, out: dict[str, JaggedTensor], part: HotInput, rows: list[torch.Tensor]
    ) -> dict[str, JaggedTensor]:
        """The collection's per-id output (`{feature: JaggedTensor}`, the sharded ids' rows)
        with the hot ids' `rows` put back in their places, every feature's lengths whole."""
        colds = [out[key].values() for key in part.keys]  # [cold ids of the feature, dim] each
        ends = list(itertools.accumulate(c.shape[0] for c in colds))
        # The batch's cold ids are its features' in order: feature k's are positions a..b.
        positions = [
            part.cold_positions[b - c.shape[0] : b] for c, b in zip(colds, ends, strict=True)
        ]
        positions += [ids.positions for ids in part.widths]
        dtype = colds[0].dtype if colds else rows[0].dtype
        sources = [*colds, *(hot.to(dtype) for hot in rows)]
        merged = PlaceRows.apply(part.key_ends[-1], positions, *sources)  # [n, dim]
        sizes = [b - a for a, b in zip(part.key_ends, part.key_ends[1:], strict=False)]
        stride, whole = part.stride, {}
        for k, (key, values) in enumerate(zip(part.keys, merged.split(sizes), strict=True)):
            whole[key] = JaggedTensor(
                values=values, lengths=part.lengths[k * stride : (k + 1) * stride]
            )
        return {key: whole.get(key, jt) for key, jt in out.items()}

    def _ready(self, part: HotInput) -> None:
        """Before a batch reads the replica: the last step applied, the replica read from the
        shards if stale, and (training) the rows the batch touches counted for the update."""
        self.finish_step()
        if self.stale and self.reader is not None:
            self.reader(self)
        if torch.is_grad_enabled() and part.widths:
            self._reduction.expect(part.touched_counts)

    def combine(
        self, kt: KeyedTensor, part: HotInput, pooled: dict[str, torch.Tensor]
    ) -> KeyedTensor:
        """The collection's output with the hot rows' part added, feature by feature, in place
        (the output is the output dist's fresh tensor, read by nothing else)."""
        values, stride = kt.values(), part.stride
        key_index = {k: i for i, k in enumerate(part.keys)}
        spans, means, hots, start = [], [], [], 0
        for key, width in zip(kt.keys(), kt.length_per_key(), strict=True):
            if key in pooled:
                spans.append((start, width))
                hots.append(pooled[key])
                mean = None
                if key in self.mean_features:
                    bags = slice(key_index[key] * stride, (key_index[key] + 1) * stride)
                    total = part.lengths[bags].to(values.dtype)
                    cold_ids = total - part.hot_per_bag[bags].to(values.dtype)
                    mean = (cold_ids.unsqueeze(1), total.clamp(min=1).unsqueeze(1))
                means.append(mean)
            start += width
        return KeyedTensor(
            keys=kt.keys(),
            length_per_key=kt.length_per_key(),
            values=AddColumns.apply(values, spans, means, *hots),
            key_dim=1,
        )

    # ------------------------------------------------------------ the update
    def _collect(self, width: int, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Backward: the gradient rows `[h, dim]` of one width's hot ids (`rows` `[h]`)."""
        self._grads.append((width, rows, grads))

    def _step(self, trigger: torch.Tensor) -> None:
        """After backward: start reducing the gradient rows the backward handed in over the
        ranks (`Reduction.start`, not waited for: the rest of the backward and the dense
        all-reduce overlap it); `finish_step` applies it before the replica is next read."""
        trigger.grad = None
        grads, self._grads = self._grads, []
        reduction = self._reduction.start(grads)
        # The rate of each table's shards, -1 where this rank holds none: the maximum over
        # the ranks is their rate (they agree), exact in float64, read on the host.
        lrs = torch.tensor(
            [self.lr_sources[n]() if n in self.lr_sources else -1.0 for n in self.tables],
            dtype=torch.float64,
        )
        work = None
        if self._host_group is not None:
            work = dist.all_reduce(lrs, op=dist.ReduceOp.MAX, group=self._host_group, async_op=True)
        self._pending = (reduction, work, lrs)

    def finish_step(self) -> None:
        """Apply the reduced gradient of the last backward, if any: each table's row optimizer
        updates the rows some rank touched (the others, and their state, stay as they are)."""
        if self._pending is None:
            return
        pending, work, lrs = self._pending
        self._pending = None
        reduced = self._reduction.finish(pending)
        if work is not None:
            work.wait()
        world = pending.world
        with torch.no_grad():
            for table, lr in zip(self.tables.values(), lrs.tolist(), strict=True):  # host rates
                if lr >= 0:
                    table.optimizer.lr = lr
                if not table.touched_only:
                    grad, used = reduced.whole[table.name]
                    weight = table.rows_of(self.flat)
                    apply_whole(table.optimizer, weight, table.state, grad.div_(world), used)
            self._update_touched(reduced, world)
            for table in self.tables.values():
                table.optimizer.step()

    def _update_touched(self, reduced: Reduced, world: int) -> None:
        """The 'touched' tables' update, width by width (`hot_reduce.apply_touched`)."""
        for index, (keys, sums) in reduced.rows.items():
            width = self.widths[index]
            tables = [
                (t.optimizer, t.row - width.row, t.ids.numel(), t.state.shape[1])
                for t in self.tables.values()
                if t.width == index and t.touched_only
            ]
            view = width.view(self.flat, scratch=True)
            apply_touched(view, width.state, keys, sums / world, tables)


_TABLE_SPAN = 1 << 40
"""Keys of one table's hot rows in `HotRows`' lookup: rows of a table with hot rows are below."""


def _running_sum(mask: torch.Tensor) -> torch.Tensor:
    """`[n + 1]`: the sum of the first i entries of `mask` (or of counts), for i = 0..n."""
    out = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(mask, 0, out=out[1:])
    return out


def _compact(
    keep: torch.Tensor, before: torch.Tensor, count: int, *tensors: torch.Tensor | None
) -> list[torch.Tensor | None]:
    """The entries of each tensor where `keep` is set (`count` of them), in order: each entry
    is scattered to its place among the kept ones (`before` `[n + 1]`: `_running_sum(keep)`),
    the others to one extra slot, cut off."""
    place = torch.where(keep, before[:-1], count)
    return [
        None
        if t is None
        else torch.empty(count + 1, dtype=t.dtype, device=t.device).index_copy_(0, place, t)[:count]
        for t in tensors
    ]
