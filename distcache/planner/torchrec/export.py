"""A distcache `Plan` as a TorchRec `ShardingPlan`, and back.

`to_sharding_plan` turns a plan into what `DistributedModelParallel` takes, for an
`EmbeddingBagCollection` whose tables are named like the workload's (`modules.workload_ebc`
builds one; a name TorchRec refuses, such as `items`, gets a suffix: `torchrec_names`):
data-parallel tables keep TorchRec's dense kernel; device-stored tables run on TorchRec's fused
kernel (FBGEMM's table-batched embedding: every row is in device memory, there is nothing to
cache, and no lookup of ours beats it); host-cached tables run on distcache's kernel
(`CACHED_KERNEL`). A table's `CacheConfig` travels in the plan (`CachedParameterSharding`) for
the cached tables and for the device tables whose hot rows distcache replicates. Pass
`CachedEmbeddingBagCollectionSharder` to DMP with it. A workload's sequence tables
(`TableStats.pooled` False) are an `EmbeddingCollection`'s (`workload_ec`), planned at their own
module path for `CachedEmbeddingCollectionSharder`; a device-stored one with hot rows runs on
distcache's kernel, a cache of every row (an `EmbeddingCollection`'s replica needs it).

`from_sharding_plan` reads a TorchRec plan, e.g. one from TorchRec's own planner, as a distcache
`Plan`, so that it is priced by the same cost model as distcache's plans. TorchRec's placements
map onto distcache's as follows (an approximation where noted):

===============================  ==========================================================
TorchRec                         distcache
===============================  ==========================================================
kernel dense / fused / quant     device storage
kernel fused_uvm_caching         host-cached, cache_fraction = the table's cache load factor
                                 (`cache_params.load_factor`, else the planner's default),
                                 lookahead 0: TorchRec's cache is reactive (LRU/LFU)
kernel fused_uvm                 host-cached, lookahead 0, with the smallest cache the cost
                                 model accepts: the rows one step touches (UVM has no cache).
                                 Nearly every touched row crosses the link each step; only
                                 rows touched by consecutive steps hit. This slightly flatters
                                 UVM, which reads every looked-up id in place, repeats included
kernel key_value and the         host-cached with the planner's default cache load factor
virtual-table kernels (SSD/KV)   (approximation: the model has no SSD tier)
kernel customized_kernel         distcache's own: read from the table's `CacheConfig`
                                 (device storage when the cache holds every row)
table_row_wise, grid_shard       table-row-wise over the shards' ranks, priced as TorchRec
                                 runs them (node-local reduce-scatter, then one all-to-all
                                 across nodes; grid: one column block per node)
table_column_wise, column_wise   column-wise over the distinct ranks of the shards, the
                                 last dropped until their number divides the dim
                                 (approximation: TorchRec's shards may differ in width or
                                 share a rank; the model splits the columns evenly)
===============================  ==========================================================

Example::

    sharding_plan = to_sharding_plan(plan, workload, world_size=8, device="cuda")
    model = DistributedModelParallel(
        model, plan=sharding_plan, sharders=[CachedEmbeddingBagCollectionSharder()], env=env
    )
    back = from_sharding_plan(sharding_plan, workload, world_size=8)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ParameterSharding, ShardingPlan, ShardingType

from distcache.cache.config import CacheConfig
from distcache.errors import DistcacheConfigError
from distcache.planner.binned import table_access
from distcache.planner.shards import on_distcache_kernel
from distcache.planner.torchrec.modules import (
    has_pooled_tables,
    has_sequence_tables,
    torchrec_names,
    workload_ebc,
    workload_ec,
)
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    HOST_CACHED,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Placement,
    Plan,
    TablePlan,
    TableStats,
    Workload,
)
from distcache.sharding.parameter_sharding import (
    CACHED_KERNEL,
    FUSED_KERNEL,
    CachedParameterSharding,
)
from distcache.sharding.sharder import (
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
)

_K = EmbeddingComputeKernel
_DEVICE_KERNELS = {_K.DENSE.value, FUSED_KERNEL, _K.QUANT.value, _K.FUSED_TRITON.value}
# Those this TorchRec has: 1.6 (the GPU machine's) lacks DRAM_SSD_VIRTUAL_TABLE.
_OFFLOAD_KERNELS = {
    getattr(_K, name).value
    for name in ("KEY_VALUE", "SSD_VIRTUAL_TABLE", "DRAM_VIRTUAL_TABLE", "DRAM_SSD_VIRTUAL_TABLE")
    if hasattr(_K, name)
}
# TorchRec widens a column-wise shard to a multiple of 4 columns (`_find_base_dim`), which
# would silently give fewer shards than ranks.
_CW_BLOCK = 4
_NODE_ROWS = {ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value}
_COLUMN_LIKE = {ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value}


# --------------------------------------------------------------------------------------------
# distcache Plan -> TorchRec ShardingPlan


HotRowIds = Callable[[TableStats, int], Sequence[int]]
"""(table, count) -> the table's `count` likeliest rows, for `TablePlan.hot_rows`."""


def hottest_rows(table: TableStats, count: int) -> list[int]:
    """A table's `count` likeliest rows: by its sampled id counts (ties by row), or, for a
    power law without counts, rows 0 .. count - 1 (its rows in popularity order)."""
    if table.counts is None:
        return list(range(min(count, table.rows)))
    order = np.argsort(-np.asarray(table.counts), kind="stable")[:count]
    return sorted(int(r) for r in order)


def cache_config_for(
    table: TablePlan, base: CacheConfig, hot_rows: Sequence[int] = ()
) -> CacheConfig:
    """The `CacheConfig` of one non-data-parallel table: `base` (optimizer, learning rate...)
    with the plan's cache size and look-ahead, and `hot_rows` replicated (the rows of its
    `TablePlan.hot_rows`, their gradient summed as its `hot_reduce`).

    Device storage is a cache holding every row; it keeps `base`'s look-ahead so that even
    first touches are staged ahead of their batch. A host-cached table without look-ahead (how
    TorchRec's UVM caching is priced) is reactive: `base.policy` if it is ('lru'/'lfu'), else
    'lru'.
    """
    base = dataclasses.replace(
        base,
        hot_rows=tuple(sorted(int(r) for r in hot_rows)),
        hot_reduce=table.hot_reduce if hot_rows else base.hot_reduce,
    )
    if table.storage != HOST_CACHED:
        return dataclasses.replace(base, capacity=1.0)
    if table.lookahead == 0:  # reactive; its window may still hold the pipeline's batches
        return dataclasses.replace(
            base,
            capacity=float(table.cache_fraction),
            prefetch_depth=0,
            policy=base.policy if base.is_reactive else "lru",
        )
    return dataclasses.replace(
        base,
        capacity=float(table.cache_fraction),
        lookahead=table.lookahead,
        prefetch_depth=table.prefetch_depth,
        policy="lookahead",
    )


def to_sharding_plan(
    plan: Plan,
    workload: Workload,
    *,
    module_path: str = "",
    sequence_module_path: str | None = None,
    world_size: int,
    ranks_per_node: int | None = None,
    device: str = "cpu",
    base_config: CacheConfig | None = None,
    hot_row_ids: HotRowIds = hottest_rows,
    device_kernel: str = FUSED_KERNEL,
) -> ShardingPlan:
    """A TorchRec `ShardingPlan` placing the EBC at `module_path` as `plan` says (its tables
    named as in `workload_ebc`: `torchrec_names`), and the workload's sequence tables
    (`TableStats.pooled` False) in the `EmbeddingCollection` at `sequence_module_path`.

    Row-wise tables span every rank (TorchRec's `row_wise`); table-row-wise tables the ranks of
    one node (TorchRec's `table_row_wise`; distcache's kernel has no grid sharding, so a
    table-row-wise table over several nodes is refused, as are other rank subsets). Column-wise
    tables split their
    columns evenly over distinct ranks (as the cost model requires, the count divides the dim),
    in shards of a multiple of 4 columns (as TorchRec requires).

    Args:
        plan: a placement of every table of `workload`.
        workload: the tables (names, rows, dims) of the EBC to shard.
        module_path: the EBC's path in the model ("" when the EBC is the model).
        sequence_module_path: the `EmbeddingCollection`'s path, for a workload with sequence
            tables (default: `module_path` when every table is a sequence table).
        world_size: ranks of the job.
        ranks_per_node: ranks per node (default: `world_size`), for placements and
            `table_row_wise`.
        device: "cpu" or "cuda", the device type of the placements.
        base_config: settings shared by every cached table (optimizer, learning rate, ...);
            default `CacheConfig(optimizer=workload.optimizer)`.
        hot_row_ids: which rows a table's `TablePlan.hot_rows` are (default `hottest_rows`:
            by its id counts, or its first rows for a power law); the data's own map when it
            hashes popularity ranks to ids.
        device_kernel: the kernel of a device-stored table: TorchRec's `"fused"` (default),
            or distcache's `CACHED_KERNEL` (a cache holding every row).

    Example::

        sharding_plan = to_sharding_plan(plan, workload, world_size=2)
    """
    _check_arguments(device, world_size, device_kernel)
    local_size = ranks_per_node or world_size
    base = base_config or CacheConfig(optimizer=workload.optimizer)
    _check_covers(plan, workload)
    names = torchrec_names(workload)
    ours = {names[t.name]: t.name for t in workload.tables}  # TorchRec's names -> the workload's
    out = {}
    for path, module, sharder_type, tables in _collections(
        workload, module_path, sequence_module_path
    ):
        per_table = {
            names[t]: _generator(plan.table(t), workload.table(t), world_size, local_size)
            for t in tables
        }
        module_plan = construct_module_sharding_plan(
            module,
            per_param_sharding=per_table,
            sharder=sharder_type(base),
            local_size=local_size,
            world_size=world_size,
            device_type=device,
        )
        for name, sharding in list(module_plan.items()):
            if sharding.sharding_type != DATA_PARALLEL:
                table_plan, stats = plan.table(ours[name]), workload.table(ours[name])
                module_plan[name] = _with_kernel(
                    sharding, table_plan, stats, base, device_kernel, hot_row_ids
                )
        out[path] = module_plan
    return ShardingPlan(out)


def _collections(
    workload: Workload, module_path: str, sequence_module_path: str | None
) -> list[tuple[str, torch.nn.Module, type, list[str]]]:
    """(path, module, distcache sharder type, its tables) of the workload's EBC and EC."""
    out: list[tuple[str, torch.nn.Module, type, list[str]]] = []
    if has_pooled_tables(workload):
        pooled = [t.name for t in workload.tables if t.pooled]
        out.append(
            (module_path, workload_ebc(workload), CachedEmbeddingBagCollectionSharder, pooled)
        )
    if has_sequence_tables(workload):
        if sequence_module_path is None and out:
            raise DistcacheConfigError(
                f"workload {workload.name!r} has pooled and sequence tables: give "
                "sequence_module_path, the EmbeddingCollection's path in the model"
            )
        path = module_path if sequence_module_path is None else sequence_module_path
        if out and path == module_path:
            raise DistcacheConfigError(
                f"sequence_module_path {path!r} is the EmbeddingBagCollection's module_path too"
            )
        sequence = [t.name for t in workload.tables if not t.pooled]
        out.append((path, workload_ec(workload), CachedEmbeddingCollectionSharder, sequence))
    return out


def _with_kernel(
    sharding: ParameterSharding,
    table_plan: TablePlan,
    stats: TableStats,
    base: CacheConfig,
    device_kernel: str,
    hot_row_ids: HotRowIds,
) -> ParameterSharding:
    """A routed table's sharding on its kernel, with its `CacheConfig` where distcache's
    kernel or replica needs one. (table_row_wise() takes no kernel argument: every kernel is
    set here.)"""
    ours = on_distcache_kernel(stats, table_plan.storage, table_plan.hot_rows)
    kernel = CACHED_KERNEL if ours else device_kernel
    sharding.compute_kernel = kernel
    if kernel != CACHED_KERNEL and not table_plan.hot_rows:
        return sharding
    fields = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)}
    hot = hot_row_ids(stats, table_plan.hot_rows) if table_plan.hot_rows else ()
    return CachedParameterSharding(**fields, cache_config=cache_config_for(table_plan, base, hot))


def _check_arguments(device: str, world_size: int, device_kernel: str) -> None:
    if device not in ("cpu", "cuda"):
        raise DistcacheConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if world_size < 1:
        raise DistcacheConfigError(f"world_size must be >= 1, got {world_size}")
    if device_kernel not in (FUSED_KERNEL, CACHED_KERNEL):
        raise DistcacheConfigError(
            f"device_kernel must be {FUSED_KERNEL!r} or {CACHED_KERNEL!r}, got {device_kernel!r}"
        )


def _check_covers(plan: Plan, workload: Workload) -> None:
    planned = [t.table for t in plan.tables]
    names = {t.name for t in workload.tables}
    missing = sorted(names - set(planned))
    extra = sorted(set(planned) - names)
    if missing or extra or len(planned) != len(set(planned)):
        raise DistcacheConfigError(
            f"plan {plan.name!r} must place each table of workload {workload.name!r} once: "
            f"missing {missing}, unknown {extra}, planned {planned}"
        )


def _generator(
    table: TablePlan, stats: TableStats, world_size: int, local_size: int
) -> ParameterShardingGenerator:
    bad = [r for r in table.ranks if not 0 <= r < world_size]
    if bad and table.sharding != DATA_PARALLEL:
        raise DistcacheConfigError(
            f"table {table.table!r}: ranks {bad} are outside [0, {world_size})"
        )
    if table.sharding == DATA_PARALLEL:
        return data_parallel()
    if table.sharding == TABLE_WISE:
        return table_wise(rank=table.ranks[0], compute_kernel=CACHED_KERNEL)
    ranks = tuple(sorted(table.ranks))
    if table.sharding == ROW_WISE:
        if ranks == tuple(range(world_size)):
            return row_wise(compute_kernel=CACHED_KERNEL)
        raise DistcacheConfigError(
            f"table {table.table!r}: row-wise over ranks {list(table.ranks)} has no TorchRec "
            f"form; use every rank (0..{world_size - 1}), or table_row_wise over the ranks of "
            f"one node ({local_size} per node)"
        )
    if table.sharding == TABLE_ROW_WISE:
        node = ranks[0] // local_size
        if ranks == tuple(range(node * local_size, min((node + 1) * local_size, world_size))):
            return table_row_wise(host_index=node)
        raise DistcacheConfigError(
            f"table {table.table!r}: table_row_wise over ranks {list(table.ranks)} is not one "
            f"node's ranks ({local_size} per node); distcache's kernel runs table_row_wise on "
            "one node (no grid sharding)"
        )
    return _column_wise(table, stats.dim)


def _column_wise(table: TablePlan, dim: int) -> ParameterShardingGenerator:
    n = len(table.ranks)
    if len(set(table.ranks)) != n or dim % n:
        # distcache's kernel holds at most one shard of a table per rank.
        raise DistcacheConfigError(
            f"table {table.table!r}: column-wise needs distinct ranks whose number divides the "
            f"dim {dim}, got {list(table.ranks)}"
        )
    if n > 1 and (dim // n) % _CW_BLOCK:
        raise DistcacheConfigError(
            f"table {table.table!r}: TorchRec's column-wise shards are multiples of {_CW_BLOCK} "
            f"columns; dim {dim} over {n} ranks gives {dim // n}"
        )
    return column_wise(ranks=list(table.ranks), compute_kernel=CACHED_KERNEL)


# --------------------------------------------------------------------------------------------
# TorchRec ShardingPlan -> distcache Plan


def from_sharding_plan(
    sharding_plan: ShardingPlan,
    workload: Workload,
    *,
    world_size: int,
    name: str = "torchrec",
    cache_load_factor: float = 0.2,
    cache_config: CacheConfig | None = None,
) -> Plan:
    """The distcache `Plan` closest to a TorchRec plan (see the module docstring for the map).

    Args:
        sharding_plan: a plan covering every table of `workload` (in any module).
        workload: the tables the plan places.
        world_size: ranks of the job (data-parallel tables live on all of them).
        name: the returned plan's name.
        cache_load_factor: cache fraction of `fused_uvm_caching` tables without
            `cache_params.load_factor` (TorchRec's planner default is 0.2).
        cache_config: the `CacheConfig` of distcache tables whose sharding carries none (a plan
            from TorchRec's planner with distcache's sharder); default `CacheConfig()`.

    Example::

        plan = from_sharding_plan(torchrec_result.plan, workload, world_size=8)
    """
    if not 0 < cache_load_factor <= 1:
        raise DistcacheConfigError(f"cache_load_factor must be in (0, 1], got {cache_load_factor}")
    conversion = _Conversion(
        workload=workload,
        world_size=world_size,
        cache_load_factor=cache_load_factor,
        default_config=cache_config or CacheConfig(),
    )
    shardings = _shardings_by_table(sharding_plan, workload)
    tables, explanations = [], {}
    for stats in workload.tables:
        sharding = shardings[stats.name]
        table = _table_plan(stats, sharding, conversion)
        tables.append(table)
        explanations[stats.name] = (
            f"from TorchRec: {sharding.sharding_type} / {sharding.compute_kernel} on ranks "
            f"{sharding.ranks}"
        )
    return Plan(name=name, tables=tuple(tables), explanations=explanations)


def _shardings_by_table(
    sharding_plan: ShardingPlan, workload: Workload
) -> dict[str, ParameterSharding]:
    """Each table's sharding, by the workload's name, from a plan that places each once."""
    # TorchRec's names (`torchrec_names`) -> the workload's; a workload name is read as itself.
    ours = {t.name: t.name for t in workload.tables}
    ours |= {trec: name for name, trec in torchrec_names(workload).items()}
    shardings: dict[str, ParameterSharding] = {}
    for module_plan in sharding_plan.plan.values():
        for key, sharding in module_plan.items():
            table = ours.get(key, key)
            if table in shardings:
                raise DistcacheConfigError(f"table {table!r} is placed by two modules")
            shardings[table] = sharding
    names = [t.name for t in workload.tables]
    missing = sorted(set(names) - set(shardings))
    extra = sorted(set(shardings) - set(names))
    if missing or extra:
        raise DistcacheConfigError(
            f"the TorchRec plan and workload {workload.name!r} differ: tables missing from the "
            f"plan {missing}, unknown to the workload {extra}"
        )
    return shardings


@dataclass(frozen=True)
class _Conversion:
    """`from_sharding_plan`'s settings, shared by its tables."""

    workload: Workload
    world_size: int
    cache_load_factor: float
    default_config: CacheConfig


def _table_plan(stats: TableStats, sharding: ParameterSharding, conv: _Conversion) -> TablePlan:
    kind, kernel = sharding.sharding_type, sharding.compute_kernel
    world_size = conv.world_size
    if kind == ShardingType.DATA_PARALLEL.value:
        return TablePlan(table=stats.name, sharding=DATA_PARALLEL, ranks=tuple(range(world_size)))
    ranks = _shard_ranks(stats.name, sharding)
    if kind == ShardingType.TABLE_WISE.value:
        sharding_type = TABLE_WISE
    elif kind == ShardingType.ROW_WISE.value:
        sharding_type, ranks = ROW_WISE, tuple(sorted(set(ranks)))
    elif kind in _NODE_ROWS:
        sharding_type, ranks = TABLE_ROW_WISE, tuple(sorted(set(ranks)))
    elif kind in _COLUMN_LIKE:
        sharding_type, ranks = COLUMN_WISE, _column_ranks(stats.dim, ranks)
    else:
        raise DistcacheConfigError(
            f"table {stats.name!r}: sharding type {kind!r} has no distcache equivalent"
        )
    split = 1
    if sharding_type == ROW_WISE:
        split = len(ranks)
    elif sharding_type == TABLE_ROW_WISE:  # rows over a node's ranks (grid: in every node)
        split = _row_splits(sharding) or len(ranks)
    shard_rows = -(-stats.rows // split)
    layout = Placement(sharding=sharding_type, shards=len(ranks))
    if kernel == _K.FUSED_UVM.value:  # no cache: model the smallest one the cost model accepts
        touched = table_access(stats).unique(
            conv.workload.batch_size_per_rank * stats.pooling_factor * world_size
        )
        placement = _cached(layout, min(1.0, math.ceil(touched / split) / shard_rows), 0, 0)
    else:
        placement = _storage(stats.name, layout, kernel, sharding, shard_rows, conv)
    config = getattr(sharding, "cache_config", None)  # distcache's sharding: its hot rows
    if config is not None and config.hot_rows:
        placement = dataclasses.replace(
            placement, hot_rows=len(config.hot_rows), hot_reduce=config.hot_reduce
        )
    return placement.table_plan(stats.name, ranks)


def _shard_ranks(table: str, sharding: ParameterSharding) -> tuple[int, ...]:
    spec = sharding.sharding_spec
    if isinstance(spec, EnumerableShardingSpec) and spec.shards:
        ranks = [s.placement.rank() for s in spec.shards if math.prod(s.shard_sizes) > 0]
    else:
        ranks = list(sharding.ranks or [])
    if not ranks:
        raise DistcacheConfigError(f"table {table!r}: the TorchRec sharding names no rank")
    return tuple(ranks)


def _row_splits(sharding: ParameterSharding) -> int:
    """How many ways the sharding splits the rows (distinct row offsets of its shards); 0 when
    its spec does not list them."""
    spec = sharding.sharding_spec
    if not isinstance(spec, EnumerableShardingSpec):
        return 0
    return len({s.shard_offsets[0] for s in spec.shards if math.prod(s.shard_sizes) > 0})


def _column_ranks(dim: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The distinct ranks of column shards, trimmed until their number divides the dim."""
    distinct = tuple(dict.fromkeys(ranks))
    while dim % len(distinct):
        distinct = distinct[:-1]
    return distinct


def _storage(
    table: str,
    layout: Placement,
    kernel: str,
    sharding: ParameterSharding,
    shard_rows: int,
    conv: _Conversion,
) -> Placement:
    """`layout` (the table's sharding and shards, on the device) stored as TorchRec's `kernel`
    stores it: its storage, cache fraction, look-ahead and prefetch depth."""
    if kernel in _DEVICE_KERNELS:
        return layout
    if kernel == _K.FUSED_UVM_CACHING.value or kernel in _OFFLOAD_KERNELS:
        params = sharding.cache_params
        factor = params.load_factor if params and params.load_factor else conv.cache_load_factor
        return _cached(layout, min(1.0, float(factor)), 0, 0)
    if kernel == CACHED_KERNEL:
        config = getattr(sharding, "cache_config", None)
        if not isinstance(sharding, CachedParameterSharding) or config is None:
            config = conv.default_config
        if isinstance(config.capacity, float):  # a fraction, as the plan's (kept exact)
            fraction = config.capacity
        else:
            fraction = config.capacity_rows(shard_rows) / shard_rows
        if config.is_reactive:
            return _cached(layout, fraction, 0, 0)
        return _cached(layout, fraction, config.lookahead, config.prefetch_depth)
    raise DistcacheConfigError(
        f"table {table!r}: compute kernel {kernel!r} has no distcache equivalent"
    )


def _cached(layout: Placement, fraction: float, lookahead: int, depth: int) -> Placement:
    """`layout` host-cached with a cache of `fraction` of its rows; on the device (as it is)
    for a cache of every row."""
    if fraction >= 1.0:
        return layout
    return dataclasses.replace(
        layout,
        storage=HOST_CACHED,
        cache_fraction=fraction,
        lookahead=lookahead,
        prefetch_depth=depth,
    )
