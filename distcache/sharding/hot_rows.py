"""Hot rows: some rows of a sharded table replicated on every rank.

A table's `CacheConfig.hot_rows` names rows (its hottest, typically) that every rank holds in a
local replica. One batch's ids flow so:

    input_dist   `HotRows.split`: each id of a hot table is looked up among its hot rows; hot
                 ids are taken out of the features before TorchRec routes them (they cross no
                 all-to-all and take no cache slot), the rest go through the table's sharding
    compute      `HotRows.pooled`: the hot ids' rows pooled from the replica on this rank,
                 `[B, dim]` per feature, each id scaled by its weight for weighted features
    output       `HotRows.combine`: added to the sharded (cold) part of the output; a mean bag
                 becomes (cold mean * cold ids + hot sum) / all ids, as pooling all its ids
    backward     the replicas' gradient (every hot table's, one flat tensor) is summed over
                 the ranks (divided by the world size, TorchRec's convention for embedding
                 gradients) in one all-reduce per collection with a count of the ranks that
                 touched each row, started when the gradient is ready and waited for when
                 the replica is next read (the next forward, a flush), then applied by each
                 table's row optimizer to the rows some rank touched; untouched rows (and
                 their optimizer state) are left as they are, as for every row of a sharded
                 table

The table stays one table for its users: a flush (before any state dict) writes the replica's
rows and optimizer state into the shards that own those rows, and after a load the replica is
read back from them (one all-reduce, at the next forward). So checkpoints hold plain tables,
and a checkpoint loads with any set of hot rows.

Splitting a batch takes its hot ids out: on CUDA that compaction reads the batch's size back,
and the features' offsets are read as host ints (both as TorchRec's own input distribution
does for its splits); the rest is fixed-shape: every id of a hot table's features is pooled,
the ids not hot with weight 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from distcache.cache.config import CacheConfig
from distcache.cache.optimizers import RowOptimizer, make_optimizer
from distcache.errors import DistcacheConfigError


@dataclass
class _HotTable:
    """One table's replicated rows."""

    name: str
    dim: int
    ids: torch.Tensor  # [H] int64 global rows, sorted
    start: int  # where its [H, dim] rows begin in the collection's flat replica
    state: torch.Tensor  # [H, state_dim] float32 optimizer state
    optimizer: RowOptimizer
    touched: torch.Tensor | None = None  # [H] bool rows this rank used in the step

    def rows_of(self, flat: torch.Tensor) -> torch.Tensor:
        """Its [H, dim] rows in `flat` (the replica, or its gradient): a view."""
        return flat[self.start : self.start + self.ids.numel() * self.dim].view(-1, self.dim)


@dataclass
class _HotIds:
    """The ids of one table's features in a batch, every one (fixed shapes: no compaction per
    feature); the ids not hot weigh 0."""

    features: list[str]  # the batch's features that read the table, in order
    slots: torch.Tensor  # [m] the id's row in the replica (any row for an id not hot)
    bags: torch.Tensor  # [m] j * B + b for the j-th of `features`, sample b
    weights: torch.Tensor  # [m] the id's weight (1.0 unweighted), 0.0 for an id not hot
    touched: torch.Tensor  # [m] the id's row in the replica, H (none) for an id not hot


@dataclass
class HotInput:
    """One batch's hot part, kept in the context from `split` to `pooled` and `combine`."""

    keys: list[str]
    tables: dict[str, _HotIds]
    hot_per_bag: torch.Tensor  # [F * B] hot ids per bag
    lengths: torch.Tensor  # [F * B] all ids per bag
    stride: int


class HotRows:
    """The hot rows of one sharded collection's tables.

    Args:
        tables: per table with hot rows: (rows, dim, its CacheConfig with `hot_rows`).
        feature_tables: the collection's features, in order, and the table each reads.
        mean_features: features pooled by mean.
        device: where the replicas live.
    """

    def __init__(
        self,
        tables: dict[str, tuple[int, int, CacheConfig]],
        feature_tables: dict[str, str],
        mean_features: set[str],
        device: torch.device,
    ):
        self.tables: dict[str, _HotTable] = {}
        start = 0
        for name, (rows, dim, config) in tables.items():
            bad = [r for r in config.hot_rows if r >= rows]
            if bad:
                raise DistcacheConfigError(
                    f"table {name!r}: hot_rows {bad[:8]} are outside its {rows} rows [0, {rows})"
                )
            ids = torch.tensor(sorted(config.hot_rows), dtype=torch.int64, device=device)
            optimizer = make_optimizer(config)
            state = torch.zeros(len(ids), optimizer.state_dim(dim), device=device)
            self.tables[name] = _HotTable(name, dim, ids, start, state, optimizer)
            start += len(ids) * dim
        # Every table's replica in one fp32 leaf (not a Parameter): one gradient, reduced in one
        # all-reduce per step for the whole collection.
        self.flat = torch.zeros(start, device=device, requires_grad=True)
        self.flat.register_post_accumulate_grad_hook(self._step)
        self.feature_tables = {f: t for f, t in feature_tables.items() if t in self.tables}
        self.mean_features = set(mean_features)
        self.device = device
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.stale = True  # the replicas must be read from the tables' shards
        # The last backward's all-reduce, still in flight: (work, gradient + counts, size).
        self._pending: tuple[dist.Work | None, torch.Tensor, int] | None = None
        self.reader: Callable[[HotRows], None] | None = None

    # ------------------------------------------------------------ the batch
    def split(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, HotInput]:
        """The features without their hot ids, and the hot part of the batch.

        Each feature of a hot table looks its ids up among the table's sorted hot rows (one
        binary search per id, on the feature's own slice of the values). Only the cold ids'
        compaction has a data-dependent size."""
        keys = features.keys()
        values, lengths = features.values(), features.lengths()
        weights = features.weights_or_none()
        stride, n = features.stride(), values.numel()
        device = values.device
        ends = features.offset_per_key()  # host ints, as TorchRec's own routing reads them
        masks: list[torch.Tensor] = []
        found: dict[str, list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]]
        found = {}
        # The bag of every id: k * B + b for feature k, sample b.
        bag_of_id = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=device), lengths, output_size=n
        )
        for k, key in enumerate(keys):
            lo, hi = ends[k], ends[k + 1]
            name = self.feature_tables.get(key)
            if name is None:
                masks.append(torch.zeros(hi - lo, dtype=torch.bool, device=device))
                continue
            table, ids = self.tables[name], values[lo:hi]
            pos = torch.searchsorted(table.ids, ids).clamp(max=table.ids.numel() - 1)
            is_hot = table.ids.index_select(0, pos) == ids
            masks.append(is_hot)
            j = len(found.get(name, ()))  # the feature's place among its table's: bags j * B + b
            bag = bag_of_id[lo:hi] + (j - k) * stride
            weight = (
                torch.ones(hi - lo, device=device) if weights is None else weights[lo:hi].float()
            )
            found.setdefault(name, []).append(
                (key, pos, bag, torch.where(is_hot, weight, 0.0), is_hot)
            )
        hot = torch.cat(masks) if masks else torch.zeros(n, dtype=torch.bool, device=device)
        hot_per_bag = torch.zeros_like(lengths).index_add_(0, bag_of_id, hot.to(lengths.dtype))
        cold = ~hot
        rest = KeyedJaggedTensor(
            keys=keys,
            values=values[cold],  # data-dependent size (see the module docstring)
            lengths=lengths - hot_per_bag,
            weights=None if weights is None else weights[cold],
            stride=stride,
        )
        tables = {}
        for name, parts in found.items():
            slots = torch.cat([part[1] for part in parts])
            none = self.tables[name].ids.numel()
            tables[name] = _HotIds(
                features=[part[0] for part in parts],
                slots=slots,
                bags=torch.cat([part[2] for part in parts]),
                weights=torch.cat([part[3] for part in parts]),
                touched=torch.where(torch.cat([part[4] for part in parts]), slots, none),
            )
        part = HotInput(
            keys=list(keys), tables=tables, hot_per_bag=hot_per_bag, lengths=lengths, stride=stride
        )
        return rest, part

    def pooled(self, part: HotInput) -> dict[str, torch.Tensor]:
        """Per hot feature, the sum of its hot ids' rows per bag `[B, dim]` (weighted): rows
        gathered, scaled (by 0 for an id not hot) and added into their bags; their gradient
        flows back the same way, without the sort of an embedding bag's backward."""
        self.finish_step()
        if self.stale and self.reader is not None:
            self.reader(self)
        out: dict[str, torch.Tensor] = {}
        for name, hot in part.tables.items():
            table = self.tables[name]
            rows = table.rows_of(self.flat).index_select(0, hot.slots) * hot.weights.unsqueeze(1)
            bags = len(hot.features) * part.stride
            zeros = torch.zeros(bags, table.dim, dtype=rows.dtype, device=rows.device)
            sums = zeros.index_add(0, hot.bags, rows)
            if torch.is_grad_enabled():
                used = torch.zeros(table.ids.numel() + 1, dtype=torch.bool, device=self.device)
                table.touched = used.index_fill_(0, hot.touched, True)[:-1]
            for j, feature in enumerate(hot.features):
                out[feature] = sums[j * part.stride : (j + 1) * part.stride]
        return out

    def combine(
        self, kt: KeyedTensor, part: HotInput, pooled: dict[str, torch.Tensor]
    ) -> KeyedTensor:
        """The collection's output with the hot rows' part added, feature by feature."""
        values, columns, start = kt.values(), [], 0
        stride = part.stride
        key_index = {k: i for i, k in enumerate(part.keys)}
        for key, width in zip(kt.keys(), kt.length_per_key(), strict=True):
            cold = values[:, start : start + width]
            start += width
            if key not in pooled:
                columns.append(cold)
                continue
            hot = pooled[key]
            if key in self.mean_features:
                k = key_index[key]
                bags = slice(k * stride, (k + 1) * stride)
                total = part.lengths[bags].to(values.dtype)
                cold_ids = total - part.hot_per_bag[bags].to(values.dtype)
                cold = (cold * cold_ids.unsqueeze(1) + hot) / total.clamp(min=1).unsqueeze(1)
            else:
                cold = cold + hot
            columns.append(cold)
        return KeyedTensor(
            keys=kt.keys(),
            length_per_key=kt.length_per_key(),
            values=torch.cat(columns, dim=1),
            key_dim=1,
        )

    # ------------------------------------------------------------ the update
    def _step(self, flat: torch.Tensor) -> None:
        """After backward: start reducing the collection's replica gradient and touched rows
        over the ranks (one all-reduce, not waited for: the rest of the backward and the
        dense all-reduce overlap it); `finish_step` applies it before the replica is next read."""
        grad, flat.grad = flat.grad, None
        touched = [
            t.touched if t.touched is not None else torch.zeros_like(t.ids, dtype=torch.bool)
            for t in self.tables.values()
        ]
        for table in self.tables.values():
            table.touched = None
        both = torch.cat([grad, torch.cat(touched).to(grad.dtype)])
        work = None
        if self._group is not None:
            work = dist.all_reduce(both, group=self._group, async_op=True)
        self._pending = (work, both, grad.numel())

    def finish_step(self) -> None:
        """Apply the reduced gradient of the last backward, if any: each table's row optimizer
        updates the rows some rank touched (the others, and their state, stay as they are)."""
        if self._pending is None:
            return
        work, both, size = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        world = dist.get_world_size(self._group) if self._group is not None else 1
        grad, counts = both[:size].div_(world), both[size:]
        flat, first = self.flat.detach(), 0
        with torch.no_grad():
            for table in self.tables.values():
                count = table.ids.numel()
                used = (counts[first : first + count] > 0).unsqueeze(1)
                first += count
                weight = table.rows_of(flat)
                rows, state = weight.clone(), table.state.clone()
                table.optimizer.update(rows, state, table.rows_of(grad))
                weight.copy_(torch.where(used, rows, weight))
                table.state.copy_(torch.where(used, state, table.state))
                table.optimizer.step()

    # ------------------------------------------------------------ the tables' shards
    def gather(self, shards: list[tuple[str, int, int, torch.Tensor, list[torch.Tensor]]]) -> None:
        """Read the replicas from the shards (all ranks at once: one all-reduce per table).

        `shards`: this rank's shards of hot tables as (table, first row, first column, rows
        `[r, c]`, optimizer state as blocks `[r, s_i]` whose columns, side by side, are the
        row optimizer's state layout)."""
        self.finish_step()
        for name, table in self.tables.items():
            dim, width = table.dim, table.state.shape[1]
            # Rows, state, and how many shards gave each row's state (column shards each keep a
            # row-wise state of their own: the replica takes their mean).
            buf = torch.zeros(table.ids.numel(), dim + width + 1, device=self.device)
            for shard_table, row0, col0, rows, state in shards:
                if shard_table != name:
                    continue
                local, mine = self._local(table, row0, rows.shape[0])
                part = buf.index_select(0, mine)
                part[:, col0 : col0 + rows.shape[1]] = rows.index_select(0, local).float()
                shard_state = _state_rows(state, local)
                for full, own, count in self._state_columns(table, col0, rows.shape[1]):
                    part[:, dim + full : dim + full + count] += shard_state[:, own : own + count]
                part[:, -1] += 1.0
                buf.index_copy_(0, mine, part)
            if self._group is not None:
                dist.all_reduce(buf, group=self._group)
            with torch.no_grad():
                table.rows_of(self.flat.detach()).copy_(buf[:, :dim])
                if width:
                    shared = buf[:, -1:].clamp(min=1) if self._row_wise(table) else 1.0
                    table.state.copy_(buf[:, dim : dim + width] / shared)
        self.stale = False

    def scatter(
        self, name: str, row0: int, col0: int, rows: torch.Tensor, state: list[torch.Tensor]
    ) -> None:
        """Write table `name`'s replica into one of its shards (rows `[r, c]` from `row0`,
        columns from `col0`, and the rows' optimizer state blocks, as `gather` reads them), in
        place."""
        self.finish_step()
        table = self.tables.get(name)
        if table is None or self.stale:
            return
        local, mine = self._local(table, row0, rows.shape[0])
        replica = table.rows_of(self.flat.detach())
        values = replica.index_select(0, mine)[:, col0 : col0 + rows.shape[1]]
        rows.index_copy_(0, local, values.to(rows.dtype))
        if table.state.shape[1]:
            mine_state = table.state.index_select(0, mine)
            part = _state_rows(state, local)
            for full, own, count in self._state_columns(table, col0, rows.shape[1]):
                part[:, own : own + count] = mine_state[:, full : full + count]
            first = 0
            for block in state:
                width = block.shape[1]
                block.index_copy_(0, local, part[:, first : first + width].to(block.dtype))
                first += width

    @staticmethod
    def _row_wise(table: _HotTable) -> bool:
        return table.state.shape[1] == 1

    def _state_columns(self, table: _HotTable, col0: int, cols: int) -> list[tuple[int, int, int]]:
        """(first replica state column, first shard state column, count) of a shard of
        columns [col0, col0 + cols): a row-wise state is one column; an element-wise one is
        blocks of `dim` columns (Adagrad: one, Adam: two), of which the shard holds its
        columns."""
        width = table.state.shape[1]
        if not width:
            return []
        if self._row_wise(table):
            return [(0, 0, 1)]
        return [(b * table.dim + col0, b * cols, cols) for b in range(width // table.dim)]

    def _local(self, table: _HotTable, row0: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard-local rows, replica slots) of the hot rows in [row0, row0 + count)."""
        inside = (table.ids >= row0) & (table.ids < row0 + count)
        mine = torch.arange(table.ids.numel(), device=self.device)[inside]  # host-side setup
        return table.ids[inside] - row0, mine


def _state_rows(state: list[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """Rows `local` of a shard's optimizer state blocks, side by side: `[n, sum s_i]` fp32."""
    blocks = [block.index_select(0, local).float() for block in state]
    return torch.cat(blocks, 1) if blocks else torch.zeros(local.numel(), 0, device=local.device)
