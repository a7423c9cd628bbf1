"""A collection's hot-row replicas and the shards that own their rows: the replicas read from
the shards (`read_replicas`, after a load: one all-reduce per table) and written back into
them (`write_replica`, when the caches flush or a state dict is taken), so that checkpoints
hold plain tables. `hot_setup.HotRowsSetup` finds the shards; `hot_rows.HotRows` keeps the
replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distcache.sharding.hot_rows import HotRows, HotTable

Shard = tuple[str, int, int, torch.Tensor, list[torch.Tensor]]
"""A shard of a hot table on this rank: (table, first row, first column, rows `[r, c]`, its
optimizer state as blocks `[r, s_i]` whose columns, side by side, are the row optimizer's
state layout)."""


def read_replicas(hot: HotRows, shards: list[Shard]) -> None:
    """Read the replicas from the shards (all ranks at once: one all-reduce per table).

    `shards`: this rank's shards of hot tables (`Shard`)."""
    hot.finish_step()
    for name, table in hot.tables.items():
        dim, width = table.dim, table.state.shape[1]
        # Rows, state, and how many shards gave each row's state (column shards each keep a
        # row-wise state of their own: the replica takes their mean).
        buf = torch.zeros(table.ids.numel(), dim + width + 1, device=hot.device)
        for shard_table, row0, col0, rows, state in shards:
            if shard_table != name:
                continue
            local, mine = _local(hot, table, row0, rows.shape[0], rows.device)
            part = buf.index_select(0, mine)
            part[:, col0 : col0 + rows.shape[1]] = rows.index_select(0, local).to(part)
            shard_state = _state_rows(state, local).to(part)
            for full, own, count in _state_columns(table, col0, rows.shape[1]):
                part[:, dim + full : dim + full + count] += shard_state[:, own : own + count]
            part[:, -1] += 1.0
            buf.index_copy_(0, mine, part)
        if hot.data_group is not None:
            dist.all_reduce(buf, group=hot.data_group)
        with torch.no_grad():
            table.rows_of(hot.flat.detach()).copy_(buf[:, :dim])
            if width:
                shared = buf[:, -1:].clamp(min=1) if _row_wise(table) else 1.0
                table.state.copy_(buf[:, dim : dim + width] / shared)
    hot.stale = False


def write_replica(
    hot: HotRows, name: str, row0: int, col0: int, rows: torch.Tensor, state: list[torch.Tensor]
) -> None:
    """Write table `name`'s replica into one of its shards (rows `[r, c]` from `row0`,
    columns from `col0`, and the rows' optimizer state blocks, as `read_replicas` reads
    them), in place."""
    hot.finish_step()
    table = hot.tables.get(name)
    if table is None or hot.stale:
        return
    local, mine = _local(hot, table, row0, rows.shape[0], rows.device)
    replica = table.rows_of(hot.flat.detach())
    values = replica.index_select(0, mine)[:, col0 : col0 + rows.shape[1]]
    rows.index_copy_(0, local, values.to(rows))
    if table.state.shape[1]:
        part = _state_rows(state, local)
        mine_state = table.state.index_select(0, mine).to(part)
        for full, own, count in _state_columns(table, col0, rows.shape[1]):
            part[:, own : own + count] = mine_state[:, full : full + count]
        first = 0
        for block in state:
            width = block.shape[1]
            block.index_copy_(0, local, part[:, first : first + width].to(block))
            first += width


def _row_wise(table: HotTable) -> bool:
    """Whether the table's optimizer keeps one state column a row (row-wise Adagrad)."""
    return table.state.shape[1] == 1


def _state_columns(table: HotTable, col0: int, cols: int) -> list[tuple[int, int, int]]:
    """(first replica state column, first shard state column, count) of a shard of
    columns [col0, col0 + cols): a row-wise state is one column; an element-wise one is
    blocks of `dim` columns (Adagrad: one, Adam: two), of which the shard holds its
    columns."""
    width = table.state.shape[1]
    if not width:
        return []
    if _row_wise(table):
        return [(0, 0, 1)]
    return [(b * table.dim + col0, b * cols, cols) for b in range(width // table.dim)]


def _local(
    hot: HotRows, table: HotTable, row0: int, count: int, shard: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(shard-local rows, on `shard`; replica slots) of the hot rows in [row0, row0 + count)."""
    inside = (table.ids >= row0) & (table.ids < row0 + count)
    mine = torch.arange(table.ids.numel(), device=hot.device)[inside]  # host-side setup
    return (table.ids[inside] - row0).to(shard), mine


def _state_rows(state: list[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """Rows `local` of a shard's optimizer state blocks, side by side: `[n, sum s_i]` fp32."""
    blocks = [block.index_select(0, local).float() for block in state]
    return torch.cat(blocks, 1) if blocks else torch.zeros(local.numel(), 0, device=local.device)
