"""Per-shard terms of the cost model: the work, traffic and memory of one shard of a table on
its rank per step — lookups, a data-parallel table's dense update, a cache's staging, the
all-to-all bytes it exchanges with each peer, their times from the topology's rates
(`rates.py`). The formulas are in `cost.py`'s docstring.

Example::

    placement = Placement(sharding=ROW_WISE, shards=8, storage=HOST_CACHED,
                          cache_fraction=0.05, lookahead=64, prefetch_depth=1)
    terms = shard_terms(table, workload, topology, placement)
    print(terms.lookup_s, terms.staging_s, terms.device_memory_bytes)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from distcache.cache.capacity import maps_bytes
from distcache.constants import HOT_ALL, HOT_TOUCHED
from distcache.planner.binned import table_access
from distcache.planner.rates import (
    cache_staging,
    cache_work_on_device,
    cache_work_s,
    dense_update_time_s,
    lookup_time_s,
    reactive_cache_time_s,
)
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    HOST_CACHED,
    OPTIMIZER_STATE,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Placement,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)

ID_BYTES = 8  # int64 ids in the input all-to-all
FP32_BYTES = 4  # a hot-row replica's rows, gradient and state


@dataclass(frozen=True, kw_only=True)
class ShardTerms:
    """The modelled work and memory of one shard of a table on its rank, per step."""

    shard_rows: int
    shard_dim: int
    row_bytes: int
    """Bytes of one stored row of the shard, optimizer state included."""
    ids_per_step: float
    unique_rows_per_step: float
    lookup_s: float
    cache_rows: int
    """Rows of the device cache (the shard's rows for device storage)."""
    working_set_rows: float
    """Rows the K + 1 batches in flight touch; the cache must hold them (0 for device)."""
    loads_per_step: float
    staging_bytes_per_step: float
    staging_s: float
    staging_overlapped: bool
    """Staging runs beside compute: look-ahead with K > 0 on a GPU (on CPU it never does)."""
    scheduling_s: float = 0.0
    """A cache's own work beside its lookups per step, a look-ahead cache's scheduler's (or a
    reactive cache's per miss, `reactive_cache_miss_s`): part of `staging_s` on CPU, of
    `lookup_s` on a GPU (`cache_work_on_device`)."""
    device_memory_bytes: int
    host_memory_bytes: int
    ids_bytes_per_peer: float
    """Input all-to-all: bytes each consumer rank sends this shard."""
    embedding_bytes_per_peer: float
    """Output all-to-all: bytes this shard sends each consumer rank (forward; backward same),
    as priced: row-wise outputs' bytes weighted by `output_rate_factor`."""
    all_reduce_bytes: float
    """Gradient bytes all-reduced each step (data parallel only)."""
    reduced_in_node: bool = False
    """Table-row-wise: the shards' partial sums are reduce-scattered within their node, then
    sent across nodes once (`ranks.shard_contribution`), instead of each shard answering
    every consumer."""
    hot_rows: int = 0
    """Rows replicated on every rank (`TablePlan.hot_rows`); the terms above are the rest's."""
    pooling_factor: float = 1.0
    """The table's ids a bag (what turns routed ids into routed bags)."""
    hot_fraction: float = 0.0
    """Share of the table's lookups the replica serves."""
    hot_lookup_s: float = 0.0
    """Every rank: its batch's hot lookups (forward, backward) and the replica's masked update."""
    hot_reduce: str = HOT_ALL
    """How the replica's gradient is summed over the ranks (`TablePlan.hot_reduce`)."""
    hot_reduce_bytes: float = 0.0
    """Every rank: the replica's gradient and touched flags, all-reduced each step ('all')."""
    hot_gather_bytes: float = 0.0
    """Every rank: the rows of the replica its batch touched, with their row numbers, which
    every other rank receives in an all-gather each step ('touched')."""
    hot_device_bytes: int = 0
    """Every rank: the replica (fp32 rows, optimizer state and gradient)."""
    collectives: str = ""
    """Which collectives route the shard's ids and outputs (`collective_kind`): tables of one
    kind share them (one input and one output dist per kind and step)."""

    @property
    def staging_parts(self) -> tuple[float, float]:
        """(overlapped, exposed) staging seconds: `staging_s` in one, 0 in the other."""
        if self.staging_overlapped:
            return self.staging_s, 0.0
        return 0.0, self.staging_s

    @property
    def fits_working_set(self) -> bool:
        return self.cache_rows >= math.ceil(self.working_set_rows - 1e-9)

    @classmethod
    def of(cls, **values: object) -> ShardTerms:
        """`ShardTerms(**values)` without the frozen `__init__`'s per-field `object.__setattr__`
        (9 of `shard_terms`' 12 us; the solver makes tens of thousands): the fields set
        directly, those not given at their defaults. Every field without a default is given."""
        terms = object.__new__(cls)
        terms.__dict__.update(_TERM_DEFAULTS, **values)
        return terms

    def replaced(self, **changes: object) -> ShardTerms:
        """`dataclasses.replace(self, **changes)`, as quickly as `of`."""
        terms = object.__new__(type(self))
        terms.__dict__.update(self.__dict__, **changes)
        return terms


_TERM_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(ShardTerms)
    if f.default is not dataclasses.MISSING
}


def output_rate_factor(sharding: str, topology: Topology, pooled: bool = True) -> float:
    """How many all-to-all bytes a byte of `sharding`'s output costs:
    `Topology.row_wise_output_slowdown` for a pooled row-wise table (TorchRec reduce-scatters
    its partial sums), else 1 (a sequence table's row-wise outputs go through an all-to-all).
    The output terms (`ShardTerms.embedding_bytes_per_peer`) are priced bytes:
    `cost.all_to_all_sent_bytes` gives the bytes sent."""
    return topology.row_wise_output_slowdown if sharding == ROW_WISE and pooled else 1.0


SEQUENCE = "sequence"  # the collectives of an `EmbeddingCollection`'s sharding


def collective_kind(sharding: str, pooled: bool = True) -> str:
    """The collectives a table of `sharding` goes through: its sharding type, or for a
    sequence table ('row_wise/sequence'...) the `EmbeddingCollection`'s own, which TorchRec
    runs apart from the bag collection's. Data-parallel tables route nothing."""
    if pooled or sharding == DATA_PARALLEL:
        return sharding
    return f"{sharding}/{SEQUENCE}"


def splits(sharding: str, shards: int, topology: Topology) -> tuple[int, int]:
    """(row splits, column splits) of a table of `shards` shards: row-wise splits rows over
    every shard, column-wise columns; table-row-wise splits rows over a node's ranks and
    columns over its nodes (one node: rows only)."""
    if sharding == ROW_WISE:
        return shards, 1
    if sharding == COLUMN_WISE:
        return 1, shards
    if sharding == TABLE_ROW_WISE:
        per_node = min(shards, topology.ranks_per_node)
        return per_node, max(1, shards // per_node)
    return 1, 1


def shard_access(
    table: TableStats,
    workload: Workload,
    topology: Topology,
    *,
    sharding: str,
    shards: int,
    hot_rows: int = 0,
) -> tuple[int, float, float]:
    """(rows, ids served, distinct rows touched) per step of one shard of `table`, its
    `hot_rows` likeliest rows served by their replicas; for data parallel the distinct rows
    are all rows (a dense gradient updates every row)."""
    per_rank_ids = workload.batch_size_per_rank * table.pooling_factor
    global_ids = per_rank_ids * topology.world_size
    if sharding == DATA_PARALLEL:
        return table.rows, per_rank_ids, float(table.rows)
    access = table_access(table)
    hot_mass, hot_unique = access.head(hot_rows, global_ids) if hot_rows else (0.0, 0.0)
    unique = max(access.unique(global_ids) - hot_unique, 0.0)
    rows_split, _ = splits(sharding, shards, topology)
    served = global_ids * (1.0 - hot_mass)
    return -(-table.rows // rows_split), served / rows_split, unique / rows_split


def shard_terms(
    table: TableStats,
    workload: Workload,
    topology: Topology,
    placement: Placement,
    access: tuple[int, float, float] | None = None,
) -> ShardTerms:
    """The terms of one shard of `table` placed as `placement` says (see the module docstring).

    Args:
        table: the table.
        workload: batch size, optimizer and dtype.
        topology: rates and world size.
        placement: sharding, shards (ignored for data parallel), storage, cache and replica.
        access: `shard_access` of the placement, where the caller has it (the solver prices
            a dozen modes of each layout, which share it).
    """
    sharding, shards, storage = placement.sharding, placement.shards, placement.storage
    lookahead, prefetch_depth = placement.lookahead, placement.prefetch_depth
    dtype = workload.dtype_bytes
    per_rank_ids = workload.batch_size_per_rank * table.pooling_factor
    pooling = table.pooling_factor if table.pooling_factor > 0 else 1.0  # ids a bag
    global_ids = per_rank_ids * topology.world_size
    rows_split, columns_split = splits(sharding, shards, topology)
    dim = table.dim // columns_split
    element = workload.element_bytes(table)  # the rows' dtype; state and outputs: `dtype`
    row_bytes = dim * element + OPTIMIZER_STATE[workload.optimizer](dim) * dtype
    sharded = sharding != DATA_PARALLEL
    hot_rows = placement.hot_rows if sharded else 0
    rows, ids, unique = access or shard_access(
        table, workload, topology, sharding=sharding, shards=shards, hot_rows=hot_rows
    )
    cached = storage == HOST_CACHED
    cache_rows = min(rows, math.ceil(placement.cache_fraction * rows)) if cached else rows
    loads = scheduling = 0.0
    if cached:
        # Row splits: the table's cache is the shards' caches together. Hot rows take no slot:
        # the cache holds the next likeliest rows, as one of `hot_rows` more slots would.
        slots = cache_rows * rows_split + hot_rows
        model = "frequency" if lookahead > 0 else "lru"
        loads = table_access(table).loads(global_ids, slots, model) / rows_split
        scheduling = cache_work_s(
            topology, lookahead=lookahead, loads=loads, cache_rows=cache_rows, ids=ids,
            unique_rows=unique, prefetch_depth=prefetch_depth,
        )  # fmt: skip
    staging_bytes = 2 * loads * row_bytes
    scheduling, staging_s = cache_staging(topology, staging_bytes, scheduling, lookahead)
    hot_mass = table_access(table).head_mass(hot_rows) if hot_rows else 0.0
    sent = _output_rows_per_peer(table, workload, sharding, rows_split, hot_mass) * dim * dtype
    sent *= output_rate_factor(sharding, topology, table.pooled)
    dim_bytes, bags = dim * element, ids / pooling
    ours = cached or (sharded and on_distcache_kernel(table, storage, hot_rows))
    lookup_s = _lookup_s(ids, bags, unique, rows, dim_bytes, row_bytes, sharded, ours, topology)
    lookup_s += scheduling * cache_work_on_device(topology)
    lookup_s += reactive_cache_time_s(topology, ids, cached, lookahead)
    return ShardTerms.of(
        shard_rows=rows,
        shard_dim=dim,
        row_bytes=row_bytes,
        ids_per_step=ids,
        unique_rows_per_step=unique,
        lookup_s=lookup_s,
        cache_rows=cache_rows,
        working_set_rows=(prefetch_depth + 1) * unique if cached else 0.0,
        loads_per_step=loads,
        staging_bytes_per_step=staging_bytes,
        staging_s=staging_s,
        staging_overlapped=min(lookahead, prefetch_depth) > 0 and topology.compute_device == "cuda",
        scheduling_s=scheduling,
        device_memory_bytes=_device_bytes(rows, cache_rows, row_bytes, ours, lookahead),
        host_memory_bytes=rows * row_bytes if ours else 0,
        ids_bytes_per_peer=per_rank_ids * (1 - hot_mass) * ID_BYTES / rows_split * sharded,
        embedding_bytes_per_peer=sent if sharded else 0.0,
        all_reduce_bytes=0.0 if sharded else table.rows * table.dim * dtype,
        reduced_in_node=sharding == TABLE_ROW_WISE,
        pooling_factor=pooling,
        collectives=collective_kind(sharding, table.pooled),
        **_hot_terms(table, workload, topology, hot_rows, hot_mass, placement.hot_reduce),
    )


def reduced_as(
    terms: ShardTerms, table: TableStats, workload: Workload, topology: Topology, hot_reduce: str
) -> ShardTerms:
    """`terms` (`shard_terms` of `table`) with the replica's gradient summed as `hot_reduce`
    (`TablePlan.hot_reduce`): only the `hot_*` terms depend on it."""
    if not terms.hot_rows:
        return terms
    hot = _hot_terms(table, workload, topology, terms.hot_rows, terms.hot_fraction, hot_reduce)
    return terms.replaced(**hot)


def on_distcache_kernel(table: TableStats, storage: str, hot_rows: int) -> bool:
    """Whether a sharded table runs on distcache's kernel (`torchrec.export.to_sharding_plan`
    places it so): host-cached, or a device-stored sequence table with a replica, which runs
    as a cache holding every row (an `EmbeddingCollection`'s replica needs that kernel): our
    lookups, the cache's slots on the device and its store in host memory. Other device tables
    run on TorchRec's."""
    return storage == HOST_CACHED or (hot_rows > 0 and not table.pooled)


def _output_rows_per_peer(
    table: TableStats, workload: Workload, sharding: str, rows_split: int, hot_mass: float
) -> float:
    """Output rows a shard sends each consumer rank per step (forward; the backward returns as
    many gradients).

    Pooled: one a bag, B. With hot rows, table- and column-wise outputs skip the bags whose
    ids were all hot (`sharding.compact_dist`), about hot_mass ** pooling of them (each of a
    bag's ids hot with probability hot_mass); the other shardings reduce partial sums and send
    every bag. Sequence: one an id the shard served, B·P / row splits, the cold ones only
    (hot ids are looked up in the replica and never routed)."""
    batch = workload.batch_size_per_rank
    if not table.pooled:
        return batch * table.pooling_factor * (1.0 - hot_mass) / rows_split
    if hot_mass <= 0.0 or sharding not in (TABLE_WISE, COLUMN_WISE):
        return float(batch)
    return batch * (1.0 - hot_mass ** max(1.0, table.pooling_factor))


def _hot_terms(
    table: TableStats,
    workload: Workload,
    topology: Topology,
    hot_rows: int,
    hot_mass: float,
    hot_reduce: str = HOT_ALL,
) -> dict[str, float | int | str]:
    """The replica's terms on every rank (`ShardTerms.hot_*`): fp32 rows of the whole dim, as
    `sharding.hot_rows` keeps them. The lookups of the rank's own batch, then the update:
    every replica row and its state read and written once (a masked update), at the dense
    update's rate. The gradient is summed by an all-reduce of every row with a touched flag
    ('all'), or by an all-gather of the rows the rank's batch touched, each with its row
    number (`sharding.hot_reduce`): as many as the most any rank touched, as the runtime
    sends them (`BinnedProfile.head_most`: the expected number from the access profile plus
    its spread times the expected maximum of W normals); then only the rows some rank touched
    are updated (the global batch's distinct hot rows). Before that,
    `HotRows.split` reads every id of the table's features: a binary search among the hot rows
    and a compaction, priced as two accesses of the id's bytes per id (read, written); the
    framework's own cost of that path, per bag, is `Topology.hot_bag_overhead_s` (calibrated)."""
    if not hot_rows:
        return {}
    state = OPTIMIZER_STATE[workload.optimizer](table.dim) * FP32_BYTES
    row, full = table.dim * FP32_BYTES, table.dim * FP32_BYTES + state
    ids = workload.batch_size_per_rank * table.pooling_factor
    lookup = lookup_time_s(
        ids=ids * hot_mass, unique_rows=0.0, dim_bytes=row, row_bytes=full, topology=topology
    )
    lookup += lookup_time_s(
        ids=ids, unique_rows=0.0, dim_bytes=ID_BYTES, row_bytes=ID_BYTES, topology=topology
    )  # the split
    touched = hot_reduce == HOT_TOUCHED
    access = table_access(table)
    # The update streams every replica row, or (touched) only the rows some rank touched.
    updated = access.head(hot_rows, ids * topology.world_size)[1] if touched else hot_rows
    return {
        "hot_rows": hot_rows,
        "hot_fraction": hot_mass,
        "hot_lookup_s": lookup
        + topology.hot_bag_overhead_s * workload.batch_size_per_rank
        + dense_update_time_s(updated * full, topology),
        "hot_reduce": hot_reduce,
        "hot_reduce_bytes": 0.0 if touched else hot_rows * (row + FP32_BYTES),
        "hot_gather_bytes": access.head_most(hot_rows, ids, topology.world_size)
        * (row + FP32_BYTES)
        if touched
        else 0.0,
        # The replica and its state; 'all' makes its [H, dim] gradient too, 'touched' none.
        "hot_device_bytes": hot_rows * (full + (0 if touched else row)),
    }


def _lookup_s(
    ids: float,
    bags: float,
    unique: float,
    rows: int,
    dim_bytes: int,
    row_bytes: int,
    sharded: bool,
    cached: bool,
    topology: Topology,
) -> float:
    """A shard's lookups with what comes with them: a sharded table routes the `bags` it
    serves (`Topology.id_overhead_s` each); a data-parallel one updates every row densely
    instead of the rows it touched. A cached table is served by distcache's kernel, the others
    by TorchRec's (`to_sharding_plan`)."""
    lookup_s = lookup_time_s(
        ids=ids,
        unique_rows=unique if sharded else 0.0,
        dim_bytes=dim_bytes,
        row_bytes=row_bytes,
        topology=topology,
        device_stored=not cached,
    )
    if sharded:
        return lookup_s + topology.id_overhead_s * bags
    return lookup_s + dense_update_time_s(rows * row_bytes, topology)


def _device_bytes(rows: int, cache_rows: int, row_bytes: int, cached: bool, lookahead: int) -> int:
    """Device memory of a shard: its rows, or its cache's slots and the per-row index."""
    if not cached:
        return int(rows * row_bytes)
    return int(cache_rows * row_bytes + maps_bytes(rows, cache_rows, reactive=lookahead == 0))


def table_plan_terms(
    table_plan: TablePlan, table: TableStats, workload: Workload, topology: Topology
) -> ShardTerms:
    """`shard_terms` of the shards of `table_plan` (every shard of a table is alike)."""
    return shard_terms(table, workload, topology, table_plan.placement)


def sent_bags_per_rank(terms: ShardTerms, shards: int) -> float:
    """Bags each rank sends a table of `shards` shards per step, as its ids over the table's
    ids a bag (column-wise: to every shard; row-wise: each id to one); 0 for data parallel."""
    return terms.ids_bytes_per_peer / ID_BYTES * shards / terms.pooling_factor
