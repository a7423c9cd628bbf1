"""The planner's cost model: the modelled step time and memory of a plan, as plain arithmetic.

Notation (per step): B = batch per rank, W = ranks, G = B·W the global batch, and for a table
R rows, D dim, P ids per sample, e = D·dtype the bytes of an embedding row and r = e + optimizer
state the bytes of a stored row. A shard of S serves n ids touching U distinct rows:
table-wise n = G·P (S = 1), row-wise n = G·P/S (hashed ids spread evenly), column-wise n = G·P
with rows of D/S columns, data parallel n = B·P per rank; U = U_table(G·P)/S for row-wise and
U_table(n) otherwise, from `stats.expected_unique`.

- lookup (fwd + bwd) = (2·n·e + 2·U·r) / device memory bandwidth: the forward gathers n rows,
  the backward scatters n gradients and reads + writes each touched row with its optimizer
  state; e and r rounded up to 32-byte sectors (random access moves no less). With
  `lookup_rows_per_s` set (a measured CPU): (2·n + 2·U) / lookup_rows_per_s, plus
  (2·n·e + 2·U·r) / lookup_bytes_per_s when that is measured too (wide rows cost more).
- data-parallel tables: the lookup of their n ids with U = 0, plus a dense update: their
  gradient is a whole [R, D] tensor, filled, accumulated and applied by the optimizer, so
  R·r bytes stream through memory `DENSE_UPDATE_PASSES` times (or at the measured
  `dense_update_bytes_per_s`).
- staging (host-cached shards) = loads·r / host-to-device bandwidth + as many write-backs·r /
  device-to-host bandwidth (the host-to-device one where a topology has none) + 2 transfer
  latencies: loads per step from `expected_loads` — 'frequency' with look-ahead (L > 0),
  'lru' without — and as many write-backs (nearly every victim was trained). With L > 0 and
  K > 0 on a GPU it overlaps the rank's compute (dense + lookup), on the stager's own stream:
  exposed = max(0, staging - compute); else, and always on CPU (the stager copies in program
  order on the training thread), fully exposed. The cache must hold the rows of the K + 1 batches in
  flight: cache rows >= (K + 1)·U. On a calibrated CPU the host-device bandwidth is the
  stager's measured rate, and a look-ahead cache's scheduler adds its measured work per step
  (`rates.scheduling_time_s`): n·schedule_s_per_id (the ids entering its window) +
  candidates·schedule_s_per_candidate (the slots its victim choice scores,
  `rates.scheduled_candidates`: max(4096, (K + 2)·U), or every slot of a small
  cache); topologies calibrated before those figures price it as every slot scored once a
  step: + cache rows / cache_scan_rows_per_s. A reactive LRU cache's own work is priced on a
  GPU only, per id at `reactive_cache_s_per_id` (FBGEMM's UVM cache, calibrated there), in the
  lookups (`rates.reactive_cache_time_s`), and per row it loads at `reactive_cache_s_per_miss`
  (`rates.reactive_cache_miss_s`: its `scheduling_s`, once per shared cache); those figures
  hold its copies too, so where they are priced the cache has no staging term
  (`rates.reactive_cache_priced_per_id`).
  On a GPU the scheduler's kernels take the device beside training (calibrated as the
  device's time): its time is added to the rank's lookups, never hidden, while the copies
  overlap (`rates.cache_work_on_device`).
  A rank's host-cached shards of one width, sharding type and cache settings share one cache,
  as the engine runs them (`caches.py`): its loads are `binned.shared_loads` of them (the
  likeliest rows of all of them resident; 'lru': one characteristic time), into their cache
  rows together, its staging one transfer each way and one scheduler pass a step. The
  solver prices each shard's cache on its own (separable), which under 'frequency' loads no
  fewer rows; `plan_cost` prices the plan it returns with the shared caches.
- all-to-all: each consumer rank sends B·P·8 bytes of ids to each shard (row-wise: /S) and each
  shard sends B·D_shard·dtype bytes of pooled embeddings (row-wise: partial sums, D) to each
  consumer; backward sends the gradients back the same way. Table-row-wise (TorchRec's TWRW and
  grid: rows split over the k ranks of a node, columns over nodes) instead reduce-scatters the
  node's partial sums over NVLink ((k-1)/k·W·B·D_shard·dtype each way per owner), then each owner
  sends B·D_shard·dtype to the rank of its local index on every other node, and every rank receives
  that much from each owner node but its own; it adds a second output collective each way. A rank's
  time per collective is max(max(sent, received) over NVLink / intra bandwidth, same over the NIC /
  inter bandwidth): links are full duplex and both kinds run at once. Row-wise outputs are
  TorchRec's reduce-scatter (forward) and all-gather (backward): where calibrated (gloo runs them
  slower than its all-to-all), each of their bytes counts `row_wise_output_slowdown` bytes
  (`shards.output_rate_factor`), and a plan with row-wise tables adds `row_wise_output_latency_s`
  a step. Sequence tables (`TableStats.pooled` False, an `EmbeddingCollection`'s) send one
  output row per id instead of per bag: B·P·D_shard·dtype (row-wise: each shard the B·P/S ids
  it served, through an all-to-all, at no slowdown), and TorchRec has no table-row-wise or grid
  sharding for them. Latencies: each sharding type a plan uses (data parallel aside; a
  sequence table's sharding type counts apart from the pooled one's) routes its ids with 3
  collectives (TorchRec's splits, lengths and values all-to-alls), back to back as a step starts,
  each one network latency, and its embeddings with 2 (forward, backward), each entered from the
  rank's own computation: a `sync_latency_s`, which on cores shared by ranks holds the wait for a
  descheduled peer.
- all-reduce (dense MLP parameters + data-parallel tables' gradients, X bytes), hierarchical:
  2·(k-1)/k·X / intra + 2·(N-1)/N·X/k / inter for N nodes of k ranks, plus a sync latency
  (two with data-parallel tables: TorchRec all-reduces their gradients apart from the MLPs').
- dense compute = 3 · DLRM forward flops per sample · B / dense_flops_per_s, plus per step
  `dense_layer_overhead_s` for each layer (MLP layers and the interaction) and, when
  `dense_activation_bytes_per_s` is measured, the layers' activation traffic (per layer of
  i inputs and o outputs, B·dtype·(3·i + 7·o) bytes: the forward product and bias + ReLU, the
  ReLU's gradient, both backward products) at that rate. Where `interaction_s_per_element`
  is measured (`calibrate`), DLRM's dot interaction of F = tables + 1 vectors of D dims
  leaves those terms and costs B·(F·D·interaction_s_per_element + F²·interaction_s_per_pair)
  plus one layer's overhead: its products are small batched matmuls, which a CPU runs far
  below an MLP's FLOP/s (measured here: 6-20 GFLOP/s against 94).
- overhead = step_overhead_s + sharding_overhead_s per sharding type the plan uses +
  id_overhead_s per bag the rank sends (B per table; column-wise: to each of its S shards):
  host time a CPU spends in the framework; the shard serving a bag pays id_overhead_s too,
  in its lookup. (Per bag, not per id: measured here, 2,048 bags of 4 ids a table cost 1.1 x
  2,048 of one id, 8,192 of one id 2.6 x; calibration measures it with one id a bag.)
  These, the per-layer cost, the activation rate and
  the per-byte lookup cost are measured by `python -m distcache calibrate` (on one GPU too);
  the GPU presets leave them at defaults that add nothing (they assume asynchronous launches
  hide host time).
- step (per rank) = overhead + dense + lookup + exposed staging + all-to-alls + all-reduce;
  the plan's step is the slowest rank's.
- memory: device = shard rows·r (device storage), or cache rows·(r + 40 B slot metadata) +
  shard rows·(8 B look-ahead or LRU index), + data-parallel tables R·r on every rank;
  host = shard rows·r for host-cached shards. Row-wise shards are priced at ceil(R/S) rows.
- hot rows (`TablePlan.hot_rows` = H, the table's H likeliest rows replicated on every rank,
  taking a share h of its lookups and touching U_hot of its distinct rows): the shards serve
  (1 - h) of the ids and U - U_hot rows, each rank sends (1 - h) of its ids, and a cache
  loads as one of H more slots would (the hot rows no longer compete for slots). Table- and
  column-wise shards send the pooled outputs of the bags with cold ids only, 1 - h^P of them
  (P ids a bag, each hot with probability h; row-wise shards reduce partial sums of every
  bag); each such sharding type reads its split sizes from the device once a step (one
  host-to-device latency). Every rank adds the lookups of its own h·B·P hot ids, the host
  path's B·`Topology.hot_bag_overhead_s` (split, pooling, addition; calibrated on CPU, 0 on
  GPUs), and device memory H·(D·4 + state) for the fp32 rows, + H·D·4 for the gradient of
  a replica reduced 'all' (a 'touched' one makes none of size H). Its gradient is
  summed over the ranks as `TablePlan.hot_reduce` says: 'all' adds H·(D + 1)·4 bytes to the
  all-reduce (its gradient and which rows some rank touched) and a masked update streaming
  all H replica rows with their state (at the dense update's rate); 'touched' all-gathers
  as many rows as the most any rank's B·P ids touch among the H (the expected U_rank plus
  its standard deviation times the expected maximum of W standard normals), (D + 1)·4 bytes
  each (gradient and row number): `all_gather_s`, each rank receiving them from the k - 1
  others of its node over NVLink and from the W - k of other nodes over its NIC, then
  updates the U_hot
  rows the global batch touched (at the same rate). A plan with replicas pays two
  sync latencies (one all-reduce of the 'all' replicas, one of their learning rates); with
  'touched' replicas, the all-gather's and one for the all-reduce of its sizes (and none for
  the first when no replica is 'all').

The model is written in five files, each a stage of it: `binned.py` (access statistics),
`shards.py` (per-shard terms), `caches.py` (the caches shards share on a rank), `dense.py`
(dense compute and all-reduce) and `ranks.py` (per-rank accumulation and the step formula);
this file prices whole plans. Each name is
imported from the file that defines it.

Statistics come from a `BinnedProfile` of each table (rows grouped into bins of near-equal
probability), so a 40M-row table costs a few thousand operations per query; it agrees with
the exact `AccessProfile` functions to well under 1 % (tests/unit/planner/test_binned.py).

Example::

    cost = plan_cost(plan, workload, topology)
    print(cost.step_s, cost.fits, cost.violations)
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from distcache.constants import HOT_TOUCHED
from distcache.errors import DistcacheConfigError
from distcache.planner.caches import rank_caches
from distcache.planner.dense import (
    all_gather_rows_s,
    all_gather_s,
    all_reduce_rows_s,
    all_reduce_s,
    dense_compute_s,
    dense_parameter_bytes,
    sync_latency_s,
)
from distcache.planner.ranks import RankTerms, rank_step_of, shard_contribution
from distcache.planner.rates import cache_work_on_device
from distcache.planner.shards import sent_bags_per_rank, table_plan_terms
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Plan,
    PlanCost,
    StepCost,
    TablePlan,
    Topology,
    Workload,
)

INPUT_COLLECTIVES = 3  # per sharding type: TorchRec's splits, lengths and values all-to-alls
OUTPUT_COLLECTIVES = 2  # per sharding type: pooled embeddings forward, gradients backward
HOT_COLLECTIVES = 2  # a plan with hot rows: all-reduces of the replicas' gradients + rows, and
# of their learning rates; with replicas reducing their touched rows: one all-reduce fewer if
# none reduces all, and the all-gather and the all-reduce of its sizes

__all__ = [
    "all_to_all_sent_bytes",
    "HOT_COLLECTIVES",
    "INPUT_COLLECTIVES",
    "OUTPUT_COLLECTIVES",
    "GlobalTerms",
    "global_terms",
    "plan_cost",
    "validate_plan",
]


def validate_plan(plan: Plan, workload: Workload, topology: Topology) -> None:
    """Raise `DistcacheConfigError` unless `plan` places every table of `workload` exactly
    once on valid ranks of `topology` (column-wise shards must divide the dim)."""
    counts = Counter(t.table for t in plan.tables)
    known = {t.name: t for t in workload.tables}
    duplicate = sorted(n for n, k in counts.items() if k > 1)
    unknown = sorted(set(counts) - set(known))
    missing = [n for n in known if n not in counts]
    for problem, found in (
        ("planned twice", duplicate),
        ("unknown", unknown),
        ("unplanned", missing),
    ):
        if found:
            raise DistcacheConfigError(
                f"plan {plan.name!r} does not match workload {workload.name!r}: tables {problem}: "
                f"{found[:10]}{' ...' if len(found) > 10 else ''}"
            )
    world = topology.world_size
    for tp in plan.tables:
        bad = [r for r in tp.ranks if not 0 <= r < world]
        if bad:
            raise DistcacheConfigError(
                f"table {tp.table!r}: ranks {bad} are outside the world of {world} ranks"
            )
        if len(set(tp.ranks)) != len(tp.ranks):
            raise DistcacheConfigError(f"table {tp.table!r}: ranks {tp.ranks} repeat a rank")
        if tp.sharding == DATA_PARALLEL and len(tp.ranks) != world:
            raise DistcacheConfigError(
                f"table {tp.table!r}: data parallel runs on all {world} ranks, got {tp.ranks}"
            )
        dim = known[tp.table].dim
        if tp.hot_rows > known[tp.table].rows:
            raise DistcacheConfigError(
                f"table {tp.table!r}: hot_rows {tp.hot_rows} exceeds its {known[tp.table].rows} "
                "rows"
            )
        if tp.sharding == TABLE_ROW_WISE and not known[tp.table].pooled:
            raise DistcacheConfigError(
                f"table {tp.table!r} is a sequence table (pooled = false): TorchRec shards an "
                "EmbeddingCollection's tables data_parallel, table_wise, column_wise or "
                "row_wise, not table_row_wise"
            )
        if tp.sharding == TABLE_ROW_WISE:
            _check_whole_nodes(tp, dim, topology)
        if tp.sharding == COLUMN_WISE and dim % len(tp.ranks):
            raise DistcacheConfigError(
                f"table {tp.table!r}: column-wise over {len(tp.ranks)} ranks needs a dim divisible "
                f"by {len(tp.ranks)}, got dim {dim}"
            )


def _check_whole_nodes(tp: TablePlan, dim: int, topology: Topology) -> None:
    """Table-row-wise ranks are whole nodes (one node, or one per column block of the dim)."""
    per_node = topology.ranks_per_node
    nodes = sorted({r // per_node for r in tp.ranks})
    whole = [
        r for n in nodes for r in range(n * per_node, min((n + 1) * per_node, topology.world_size))
    ]
    if sorted(tp.ranks) != whole or dim % len(nodes):
        raise DistcacheConfigError(
            f"table {tp.table!r}: table-row-wise over ranks {list(tp.ranks)} must span whole "
            f"nodes of {per_node} ranks (nodes {nodes} have ranks {whole}), one column block of "
            f"the dim {dim} per node (the dim divisible by the nodes)"
        )


@dataclass(frozen=True)
class GlobalTerms:
    """What every rank pays alike, per step."""

    all_reduce_s: float
    """Dense parameters', data-parallel tables' and hot-row replicas' gradients."""
    input_latency_s: float
    """Latencies of the input all-to-alls, 3 per sharding type (data parallel aside)."""
    output_latency_s: float
    """Sync latencies of the output all-to-alls, forward and backward, 2 per sharding type."""
    overhead_s: float
    """`Topology.step_overhead_s` + `sharding_overhead_s` per sharding type used."""

    @property
    def shared_s(self) -> float:
        return self.all_reduce_s + self.input_latency_s + self.output_latency_s + self.overhead_s


def global_terms(
    workload: Workload, topology: Topology, *plan: object, dense_bytes: float | None = None
) -> GlobalTerms:
    """The shared terms of one plan, `SharedTerms.parts(*plan)`: its data-parallel bytes, the
    collectives its tables use, the bags each rank sends, its replicas. `dense_bytes`:
    `dense_parameter_bytes(workload)`, where the caller knows it."""
    return GlobalTerms(*SharedTerms(workload, topology, dense_bytes).parts(*plan))


class SharedTerms:
    """`global_terms` of the plans of one workload and topology: what depends only on the set
    of collectives a plan uses computed once per set (the solver prices thousands of plans)."""

    def __init__(self, workload: Workload, topology: Topology, dense_bytes: float | None = None):
        self.topology = topology
        self.several, self.sync = topology.world_size > 1, sync_latency_s(topology)
        self.dense_bytes = dense_parameter_bytes(workload) if dense_bytes is None else dense_bytes
        # collectives -> (input latency, output latency without and with replicas, overhead
        # without the bags sent)
        self._of_kinds: dict[frozenset[str], tuple[float, float, float, float]] = {}

    def parts(
        self,
        dp_bytes: float,
        shardings: Collection[str],
        sent_bags: float = 0.0,
        hot_bytes: float = 0.0,
        hot_tables: int = 0,
        gather_bytes: float = 0.0,
        gathered_tables: int = 0,
    ) -> tuple[float, float, float, float]:
        """`GlobalTerms`' fields, in their order (what `GlobalTerms.shared_s` sums), of a plan
        with `dp_bytes` of data-parallel gradients whose tables use the collectives `shardings`
        (the set of their `ShardTerms.collectives`: the sharding types of the pooled tables,
        'row_wise/sequence' and the like for sequence tables), each rank sending `sent_bags`
        bags per step (`sent_bags_per_rank`), and `hot_tables` tables with hot-row replicas:
        those that reduce all their rows ('all') all-reduce their gradients and touched counts
        (`hot_bytes` in all) together, one collective whatever their number; the
        `gathered_tables` of them that reduce their touched rows all-gather `gather_bytes` from
        every rank, one collective (and one small all-reduce of its sizes). The all-gather's
        time is counted in the all-reduce term."""
        topology, several, sync = self.topology, self.several, self.sync
        kinds = shardings if isinstance(shardings, frozenset) else frozenset(shardings)
        of_kinds = self._of_kinds.get(kinds) or self._kinds_terms(kinds)
        input_latency, output_latency, output_latency_hot, overhead = of_kinds
        all_reduce = all_reduce_s(self.dense_bytes + dp_bytes + hot_bytes, topology)
        if dp_bytes > 0 and several:
            all_reduce += sync  # the data-parallel tables' own all-reduce
        if hot_tables and several:  # one all-reduce of every replica
            whole = hot_tables > gathered_tables  # some replica all-reduces all its rows
            all_reduce += (HOT_COLLECTIVES - (not whole)) * sync
            if gathered_tables:
                all_reduce += all_gather_s(gather_bytes, topology) + sync
            output_latency = output_latency_hot
        return (
            all_reduce,
            input_latency,
            output_latency,
            overhead + topology.id_overhead_s * sent_bags,
        )

    def shared_s(self, *args: object) -> float:
        """`global_terms(...).shared_s` of `parts(*args)`."""
        all_reduce, input_latency, output_latency, overhead = self.parts(*args)
        return all_reduce + input_latency + output_latency + overhead

    def shared_rows_s(self, kinds: Sequence[frozenset[str]], args: np.ndarray) -> np.ndarray:
        """[K] `shared_s` of K plans priced together, equal to the bit to each one's: plan k's
        collectives are `kinds[k]` and its other arguments of `parts` the row `args[k]` (data-
        parallel bytes, sent bags, hot bytes, hot tables, gather bytes, gathered tables)."""
        topology, sync = self.topology, self.sync
        dp, sent, hot_bytes, hot_tables, gather, gathered = args.T
        of_kinds = {k: self._of_kinds.get(k) or self._kinds_terms(k) for k in set(kinds)}
        terms = np.array([of_kinds[k] for k in kinds]).reshape(len(kinds), 4)
        input_latency, output_latency, output_latency_hot, overhead = terms.T
        all_reduce = all_reduce_rows_s(self.dense_bytes + dp + hot_bytes, topology)
        if self.several:  # as `parts`, row by row
            all_reduce = np.where(dp > 0, all_reduce + sync, all_reduce)
            hot = hot_tables.astype(np.int64) != 0
            whole = hot_tables.astype(np.int64) > gathered.astype(np.int64)
            replicas = all_reduce + (HOT_COLLECTIVES - ~whole) * sync
            gathers = replicas + (all_gather_rows_s(gather, topology) + sync)
            replicas = np.where(gathered.astype(np.int64) != 0, gathers, replicas)
            all_reduce = np.where(hot, replicas, all_reduce)
            output_latency = np.where(hot, output_latency_hot, output_latency)
        overhead = overhead + topology.id_overhead_s * sent
        return all_reduce + input_latency + output_latency + overhead

    def _kinds_terms(self, kinds: frozenset[str]) -> tuple[float, float, float, float]:
        topology, several = self.topology, self.several
        routed = len(kinds - {DATA_PARALLEL}) if several else 0

        def output_latency(compact_reads: int) -> float:
            # Table-row-wise outputs take two collectives each way: the node's reduce-scatter,
            # then the all-to-all across nodes. Replicas' compaction reads its split sizes.
            return (
                OUTPUT_COLLECTIVES * self.sync * (routed + (TABLE_ROW_WISE in kinds and several))
                + compact_reads * topology.host_to_device_latency_s
                + topology.row_wise_output_latency_s * (ROW_WISE in kinds and several)
            )

        terms = (
            INPUT_COLLECTIVES * topology.network_latency_s * routed,
            output_latency(0),
            output_latency(len(kinds & {TABLE_WISE, COLUMN_WISE})),
            topology.step_overhead_s + topology.sharding_overhead_s * len(kinds),
        )
        self._of_kinds[kinds] = terms
        return terms


def plan_cost(plan: Plan, workload: Workload, topology: Topology) -> PlanCost:
    """The modelled step time per rank and memory of `plan` (see the module docstring).

    Any valid plan is priced, whoever made it: a TorchRec plan's UVM-cached tables are
    host_cached tables with lookahead 0 (a reactive LRU cache on the critical path). The
    tables of one cache on a rank share it (`caches.rank_caches`), as the engine runs them;
    `PlanCost.loads_per_step` gives the rows each rank's caches load.

    Args:
        plan: a placement of every table of `workload`.
        workload: the model and batch.
        topology: the hardware.

    Example::

        cost = plan_cost(solve(workload, topology), workload, topology)
        assert cost.fits
    """
    validate_plan(plan, workload, topology)
    tables = {t.name: t for t in workload.tables}
    load = RankTerms.zeros(topology.world_size)
    dp_bytes, sent, hot_bytes, gather_bytes, violations = 0.0, 0.0, 0.0, 0.0, []
    kinds = set()
    plan_terms = [table_plan_terms(tp, tables[tp.table], workload, topology) for tp in plan.tables]
    for tp, terms in zip(plan.tables, plan_terms, strict=True):
        kinds.add(terms.collectives)
        load += shard_contribution(terms, tp.ranks, topology)
        dp_bytes += terms.all_reduce_bytes
        hot_bytes += terms.hot_reduce_bytes
        gather_bytes += terms.hot_gather_bytes
        sent += sent_bags_per_rank(terms, len(tp.ranks))
        if not terms.fits_working_set:
            violations.append(
                f"table {tp.table!r}: cache of {terms.cache_rows} rows per shard is smaller than "
                f"the {math.ceil(terms.working_set_rows)} rows its {tp.prefetch_depth + 1} "
                "batches in flight touch"
            )
    caches = rank_caches(plan, plan_terms, workload, topology)
    loads = np.zeros(topology.world_size)
    for cache in caches:  # each rank's tables of one cache share it
        staged = load.overlapped_staging_s if cache.staging_overlapped else load.exposed_staging_s
        staged[cache.rank] += cache.staging_s - cache.separate_staging_s
        if cache_work_on_device(topology):  # its scheduler's time is the device's (`shards`)
            load.lookup_s[cache.rank] += cache.scheduling_s - cache.separate_scheduling_s
        loads[cache.rank] += sum(cache.loads_per_step)
    hot_tables = sum(tp.hot_rows > 0 for tp in plan.tables)
    gathered = sum(tp.hot_rows > 0 and tp.hot_reduce == HOT_TOUCHED for tp in plan.tables)
    shared = global_terms(
        workload, topology, dp_bytes, kinds, sent, hot_bytes, hot_tables, gather_bytes, gathered
    )
    dense = dense_compute_s(workload, topology)
    violations += _memory_violations(load, topology)
    return PlanCost(
        per_rank=_step_costs(load, dense, shared, topology),
        device_memory_bytes=tuple(int(b) for b in load.device_memory_bytes),
        host_memory_bytes=tuple(int(b) for b in load.host_memory_bytes),
        global_batch_size=workload.batch_size_per_rank * topology.world_size,
        loads_per_step=tuple(loads.tolist()),
        fits=not violations,
        violations=tuple(violations),
    )


def all_to_all_sent_bytes(plan: Plan, workload: Workload, topology: Topology) -> np.ndarray:
    """[W] bytes each rank sends other ranks per step in the ids' and embeddings' collectives
    as the model prices them: ids once, embeddings forward (what its shards send) and backward
    (the gradients of what it received), what `tools.collectives.CollectiveBytes` counts on a real
    run."""
    validate_plan(plan, workload, topology)
    tables = {t.name: t for t in workload.tables}
    load = RankTerms.zeros(topology.world_size)
    wire = dataclasses.replace(topology, row_wise_output_slowdown=1.0)  # bytes, not their price
    for tp in plan.tables:
        terms = table_plan_terms(tp, tables[tp.table], workload, wire)
        load += shard_contribution(terms, tp.ranks, wire)
    ids, emb = load.ids, load.emb
    backward = emb.received_intra + emb.received_inter
    return ids.sent_intra + ids.sent_inter + emb.sent_intra + emb.sent_inter + backward


def _memory_violations(load: RankTerms, topology: Topology) -> list[str]:
    """Ranks whose device or host memory exceeds the topology's limit."""
    out: list[str] = []
    for kind, used, limit in (
        ("device", load.device_memory_bytes, topology.device_memory_bytes),
        ("host", load.host_memory_bytes, topology.host_memory_bytes),
    ):
        out += [
            f"rank {rank}: {kind} memory {used[rank] / 1e9:.2f} GB > {limit / 1e9:.2f} GB"
            for rank in np.flatnonzero(used > limit)
        ]
    return out


def _step_costs(
    load: RankTerms, dense_s: float, shared: GlobalTerms, topology: Topology
) -> tuple[StepCost, ...]:
    step = rank_step_of(load, dense_s=dense_s, topology=topology)
    ids = step.input_all_to_all_s + shared.input_latency_s
    emb = step.output_all_to_all_s + shared.output_latency_s
    staging = load.overlapped_staging_s + load.exposed_staging_s
    return tuple(
        StepCost(
            dense_compute_s=dense_s,
            lookup_s=float(load.lookup_s[r]),
            staging_s=float(staging[r]),
            exposed_staging_s=float(step.exposed_staging_s[r]),
            input_all_to_all_s=float(ids[r]),
            output_all_to_all_s=float(emb[r]),
            all_reduce_s=shared.all_reduce_s,
            overhead_s=shared.overhead_s,
        )
        for r in range(topology.world_size)
    )
