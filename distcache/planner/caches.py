"""A plan's caches as the engine builds them: on each rank, the host-cached shards one cache
serves, what it loads per step and what its staging costs.

`shards.shard_terms` prices each shard with a cache of its own, `ceil(cache_fraction · rows)`
slots. The engine builds fewer caches: on a rank, the shards of one group share one
`CacheEngine` whose slots are their caches together, so the rows resident are the likeliest of
all of them. A shard's group is fixed by:

1. its module and sharding type: a sharded `EmbeddingBagCollection` or `EmbeddingCollection`
   builds one lookup per sharding type (`sharding.sharded_module`'s `_create_lookups`), i.e.
   per `ShardTerms.collectives`;
2. its kernel: TorchRec's `group_tables` gives one kernel to a lookup's tables of equal data
   type, pooling and fused params, and a distcache table's fused params hold its
   `CacheConfig` (`CachedParameterSharding.get_additional_fused_params`, hot rows and
   capacity left out), which `planner.torchrec.export.cache_config_for` fills from the plan:
   look-ahead L, prefetch depth K (L = 0: a reactive LRU cache);
3. its width and dtype: a kernel's `cache.module.CachedEmbeddingBags` serves the tables of
   one (shard dim, dtype) by one engine, of capacity the sum of their own
   (`cache_fraction`: `TableSpec.capacity`, `cache.capacity.shared_capacity`; it raises that
   only when the batches in flight would not fit, which `plan_cost` still reports per table).

So `cache_group` keys a shard by (collectives, shard dim, row bytes (for one dim: the dtype),
L, K), and `rank_caches` by its rank too; tests/unit/planner/torchrec/test_export.py builds
the engines of an exported plan under DMP and finds these groups. (A device-stored table on
distcache's kernel, a sequence table with a replica, is a cache of every row under the
look-ahead of the export's base config: where that is a cache's L and K, the engine shares
that cache with it, which the model, pricing it resident, leaves out.) A
row-wise (or table-row-wise) shard holds 1/rows-split of each of its table's rows, touched
as often as the table's (`binned.CacheShare`); hot rows (`TablePlan.hot_rows`) never reach
the cache, which holds the table's next likeliest rows instead.

A cache of several tables loads `binned.shared_loads` of them: the 'frequency' model with
look-ahead, 'lru' without (Che's approximation, one characteristic time for the whole cache:
distcache's reactive caches are the same shared engine). Its staging is one transfer each
way a step (`rates.staging_time_s`) and, with look-ahead, one scheduler pass over the ids and
distinct rows of all its tables (`rates.scheduling_time_s`). A TorchRec plan's
`fused_uvm_caching` tables are priced the same way, as reactive caches shared by width;
FBGEMM's UVM cache is one per table-batched kernel, which `group_tables` gives the tables of
all widths of one data type whatever their load factors, so it is shared more widely than
priced (an approximation).

A cache of one table is its `ShardTerms`' own. Of a shared cache's loads, each table's share
is its own rows' (exact under 'frequency': its touched rows outside the resident set); the
staging time is the cache's, not split among its tables. The solver prices each table's
cache on its own (`pricing.py`, the sum of `ShardTerms`, which is separable); under
'frequency' that loads at least as many rows as the shared cache (a split of the slots among
the tables is one way to choose the resident rows; the shared cache keeps the likeliest), so
its staging traffic bounds `plan_cost`'s from above.

Example::

    terms = [table_plan_terms(tp, tables[tp.table], workload, topology) for tp in plan.tables]
    for cache in rank_caches(plan, terms, workload, topology):
        print(cache.rank, cache.tables, sum(cache.loads_per_step))
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from distcache.planner.binned import CacheShare, shared_loads, table_access
from distcache.planner.rates import cache_staging, cache_work_s
from distcache.planner.shards import ShardTerms, splits
from distcache.planner.types import HOST_CACHED, Plan, TablePlan, TableStats, Topology, Workload


@dataclass(frozen=True, kw_only=True)
class RankCache:
    """One cache of one rank and the tables whose shards it serves."""

    rank: int
    tables: tuple[str, ...]
    slots: int
    """The tables' cache rows together (`ShardTerms.cache_rows`)."""
    loads_per_step: tuple[float, ...]
    """Rows of each table loaded per step."""
    staging_s: float
    """The cache's staging time per step (loads, write-backs, scheduler)."""
    separate_staging_s: float
    """The tables' `ShardTerms.staging_s` summed: their staging, each in a cache of its own."""
    staging_overlapped: bool
    """`ShardTerms.staging_overlapped` (alike for the tables of one cache)."""
    scheduling_s: float = 0.0
    """The cache's own work per step (`ShardTerms.scheduling_s`: a look-ahead cache's
    scheduler, a calibrated reactive cache's misses), in `staging_s` unless
    `cache_work_on_device`."""
    separate_scheduling_s: float = 0.0
    """The tables' `ShardTerms.scheduling_s` summed."""


def cache_group(tp: TablePlan, terms: ShardTerms) -> tuple | None:
    """The key of the engine cache `tp`'s shards join on their ranks, but for the rank (see the
    module docstring); None for a table not host-cached."""
    if tp.storage != HOST_CACHED:
        return None
    return (
        terms.collectives,
        terms.shard_dim,
        terms.row_bytes,  # for one dim and optimizer: the rows' dtype
        tp.lookahead,
        tp.prefetch_depth,
    )


def rank_caches(
    plan: Plan,
    terms: Sequence[ShardTerms],
    workload: Workload,
    topology: Topology,
) -> list[RankCache]:
    """Every cache of `plan` on every rank, as the engine builds them (module docstring).

    Args:
        plan: a valid plan.
        terms: `table_plan_terms` of each of `plan.tables`, in order.
        workload: the tables and batch.
        topology: the ranks and link rates.
    """
    members: dict[tuple, list[int]] = defaultdict(list)
    for index, (tp, t) in enumerate(zip(plan.tables, terms, strict=True)):
        key = cache_group(tp, t)
        if key is not None:
            for rank in tp.ranks:
                members[(rank, *key)].append(index)
    tables = {t.name: t for t in workload.tables}
    priced: dict[tuple[int, ...], RankCache] = {}  # ranks with the same shards: the same cache
    out = []
    for (rank, *_), indices in members.items():
        group = tuple(indices)
        if group not in priced:
            tps = [plan.tables[i] for i in group]
            priced[group] = _price(rank, tps, [terms[i] for i in group], tables, workload, topology)
        out.append(dataclasses.replace(priced[group], rank=rank))
    return out


def _price(
    rank: int,
    tps: Sequence[TablePlan],
    terms: Sequence[ShardTerms],
    tables: dict[str, TableStats],
    workload: Workload,
    topology: Topology,
) -> RankCache:
    """The cache of `rank` serving the shards of `tps` (their `terms`)."""
    first, lookahead = terms[0], tps[0].lookahead
    slots = sum(t.cache_rows for t in terms)
    separate = sum(t.staging_s for t in terms)
    separate_scheduling = sum(t.scheduling_s for t in terms)
    loads, staging, scheduling = (first.loads_per_step,), separate, separate_scheduling
    if len(tps) > 1:
        shares = [
            CacheShare(
                profile=table_access(tables[tp.table]),
                lookups=workload.batch_size_per_rank
                * tables[tp.table].pooling_factor
                * topology.world_size,
                rows_split=splits(tp.sharding, len(tp.ranks), topology)[0],
                hot_rows=tp.hot_rows,
            )
            for tp in tps
        ]
        shared = shared_loads(shares, slots, "frequency" if lookahead > 0 else "lru")
        scheduling = cache_work_s(
            topology,
            lookahead=lookahead,
            loads=float(shared.sum()),
            cache_rows=slots,
            ids=sum(t.ids_per_step for t in terms),
            unique_rows=sum(t.unique_rows_per_step for t in terms),
            prefetch_depth=tps[0].prefetch_depth,
        )
        loads = tuple(shared.tolist())
        moved = 2 * float(shared.sum()) * first.row_bytes
        scheduling, staging = cache_staging(topology, moved, scheduling, lookahead)
    return RankCache(
        rank=rank,
        tables=tuple(tp.table for tp in tps),
        slots=slots,
        loads_per_step=loads,
        staging_s=staging,
        separate_staging_s=separate,
        staging_overlapped=first.staging_overlapped,
        scheduling_s=scheduling,
        separate_scheduling_s=separate_scheduling,
    )
