"""The solver's menu: every way each table may be placed (`Mode`: a `Placement` — sharding,
shard count, storage, cache size, look-ahead — with its terms), priced per shard once, before
any search.

Modes whose shard cannot fit an empty rank, or whose cache is smaller than its in-flight
working set, are rejected here with the reason (`Problem.rejects`, shown in the plan's
explanations). The rest are grouped by layout (`Group`: one sharding and shard count), whose
per-shard terms sit in [M, 1] columns so that `pricing.py` prices every mode of a layout on
every rank at once.

Example::

    problem = Problem(workload, topology, SolverOptions())
    modes = [m for group in problem.groups[0] for m in group.modes]  # table 0's menu
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from distcache.constants import HOT_ALL
from distcache.planner.cost import SharedTerms
from distcache.planner.dense import all_reduce_s, dense_compute_s, dense_parameter_bytes
from distcache.planner.ranks import expose_staging, node_layout, traffic_units
from distcache.planner.shards import ShardTerms, shard_access, shard_terms
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    HOST_CACHED,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Placement,
    SolverOptions,
    TableStats,
    Topology,
    Workload,
)

TIE_S = 1e-10  # seconds: step times closer than this are equal


@dataclass(frozen=True, slots=True)
class Mode:
    """One way to place a table, priced per shard (ranks chosen later)."""

    placement: Placement
    terms: ShardTerms | None
    """`shard_terms` of `placement`; None for a mode rejected before it was priced (a cache
    too small for the batches in flight: `Problem.rejects` needs only its placement)."""

    def describe(self, ranks: tuple[int, ...] = ()) -> str:
        p = self.placement
        if p.sharding == DATA_PARALLEL:
            where = "data_parallel"
        elif p.sharding == TABLE_WISE:
            where = f"table_wise on rank {ranks[0]}" if ranks else "table_wise"
        elif p.sharding == ROW_WISE:
            where = f"row_wise on {p.shards} ranks"
        else:  # column-wise and table-row-wise: the ranks named
            where = f"{p.sharding} on {p.shards} ranks" + (f" {list(ranks)}" if ranks else "")
        hot = f", {p.hot_rows} hot rows replicated" if p.hot_rows else ""
        if p.hot_rows and p.hot_reduce != HOT_ALL:
            hot += " (touched rows all-gathered)"
        if p.storage == DEVICE:
            return f"{where}, device{hot}"
        return (
            f"{where}, host + {100 * p.cache_fraction:.3g}% cache, L={p.lookahead} "
            f"K={p.prefetch_depth}{hot}"
        )


@dataclass
class Candidate:
    """A mode with its best ranks on the current state and what it does to the step."""

    mode: Mode
    ranks: tuple[int, ...]
    step_s: float
    """Max over ranks after placing."""
    work_s: float
    """Sum over ranks after placing."""
    estimate_s: float = 0.0
    reason: str = ""
    """Why it does not fit (empty when it does)."""

    @property
    def fits(self) -> bool:
        return not self.reason


class Problem:
    """The workload and topology, the constants every evaluation needs, and each table's menu
    of modes grouped by layout."""

    def __init__(self, workload: Workload, topology: Topology, options: SolverOptions):
        self.workload, self.topology, self.options = workload, topology, options
        self.world = W = topology.world_size
        self.dense_s = dense_compute_s(workload, topology)
        self.dense_bytes = dense_parameter_bytes(workload)
        self.shared = SharedTerms(workload, topology, self.dense_bytes)  # `global_terms`
        self.node, self.node_starts, self.node_size = node_layout(topology)
        self.nodes = len(self.node_starts)
        self.same_node = (self.node[None, :] == np.arange(self.nodes)[:, None]).astype(float)
        self.same_node_pairs = np.eye(self.nodes, dtype=bool)  # [N, N]
        self.device_limit = topology.device_memory_bytes
        self.host_limit = topology.host_memory_bytes
        # [W] seconds per byte a shard on each rank exchanges with every other rank (work).
        self.pair_s = (self.node_size - 1) / topology.intra_node_bw_bytes_per_s + (
            W - self.node_size
        ) / topology.inter_node_bw_bytes_per_s
        # [1] `pair_s` summed over every rank, as a row of owners prices it (`is_owner @ pair_s`)
        self.everyone_pair_s = np.ones((1, W)) @ self.pair_s
        # ([8, N, W] table-row-wise on each node, [8, 6, W]) all-to-all units: `_traffic_templates`
        self.node_units, self.units = _traffic_templates(self, topology)
        self.node_ranks = [tuple(int(r) for r in np.flatnonzero(row)) for row in self.same_node]
        self.cache: dict[tuple, object] = {}  # the stages' constants, built when first asked for
        self.tables = workload.tables
        self.lookahead_pairs = options.lookahead_pairs()
        self.rejects: list[list[Candidate]] = [[] for _ in workload.tables]
        self.groups = [self._groups(i, t) for i, t in enumerate(workload.tables)]
        self.work = [self._least_work(g) for g in self.groups]
        self.least_memory = [self._least_memory(g) for g in self.groups]
        # Each table's modes by placement (none with a replica), to reuse for seeds.
        self.known = [{m.placement: m for g in groups for m in g.modes} for groups in self.groups]

    def pair_sum(self, ranks: tuple[int, ...]) -> float:
        """`pair_s` summed over `ranks` (kept: the same few rank sets come back)."""
        key = ("pair_s", ranks)
        if key not in self.cache:
            self.cache[key] = float(self.pair_s[list(ranks)].sum())
        return self.cache[key]

    def _groups(self, index: int, table: TableStats) -> list[Group]:
        opts, layouts = self.options, []
        if DATA_PARALLEL in opts.shardings:
            layouts.append((DATA_PARALLEL, self.world))
        if TABLE_WISE in opts.shardings:
            layouts.append((TABLE_WISE, 1))
        if ROW_WISE in opts.shardings and self.world > 1:
            layouts.append((ROW_WISE, self.world))
        # (TorchRec shards an `EmbeddingCollection`'s tables neither table-row-wise nor grid.)
        if TABLE_ROW_WISE in opts.shardings and self._whole_nodes() and table.pooled:
            layouts.append((TABLE_ROW_WISE, self.topology.ranks_per_node))
        if COLUMN_WISE in opts.shardings:
            layouts += [
                (COLUMN_WISE, s)
                for s in sorted(set(opts.column_wise_shards))
                if s <= self.world and table.dim % s == 0
            ]
        groups = []
        for sharding, shards in layouts:
            modes = [
                m
                for m in self._layout_modes(index, table, sharding, shards)
                if self._fits(index, m)
            ]
            if modes:
                groups.append(Group(modes))
        return groups

    def _whole_nodes(self) -> bool:
        """Whether table-row-wise has a choice of node: several nodes, all full."""
        return self.nodes > 1 and self.world % self.topology.ranks_per_node == 0

    def _layout_modes(
        self, index: int, table: TableStats, sharding: str, shards: int
    ) -> list[Mode]:
        opts = self.options
        modes = []
        # Every mode of the layout serves the same ids (no replica here): priced once.
        access = shard_access(table, self.workload, self.topology, sharding=sharding, shards=shards)
        if DEVICE in opts.storages or sharding == DATA_PARALLEL:
            modes.append(self.mode(table, Placement(sharding=sharding, shards=shards), access))
        if HOST_CACHED not in opts.storages or sharding == DATA_PARALLEL:
            return modes
        rows, _, unique = access

        def cached(fraction: float, lookahead: int, depth: int) -> Placement:
            return Placement(
                sharding=sharding,
                shards=shards,
                storage=HOST_CACHED,
                cache_fraction=fraction,
                lookahead=lookahead,
                prefetch_depth=depth,
            )

        for L, K in self.lookahead_pairs:
            too_small = None
            for fraction in sorted(set(opts.cache_fractions)):
                if math.ceil(fraction * rows) < math.ceil((K + 1) * unique - 1e-9):
                    too_small = fraction  # cheaper to skip here than to price and reject
                    continue
                if math.ceil(fraction * rows) >= rows and DEVICE in opts.storages:
                    break  # a cache of every row: device storage without the metadata
                modes.append(self.mode(table, cached(fraction, L, K), access))
            if too_small is not None:
                reason = (
                    f"a cache of {100 * too_small:.3g}% or less holds fewer than the "
                    f"{math.ceil((K + 1) * unique)} rows of {K + 1} batches in flight"
                )
                self._reject(index, Mode(cached(too_small, L, K), None), reason)
        return modes

    def mode(
        self,
        table: TableStats,
        placement: Placement,
        access: tuple[int, float, float] | None = None,
    ) -> Mode:
        """`table` placed as `placement`, priced (`access`: its `shard_access`, if known)."""
        return Mode(placement, shard_terms(table, self.workload, self.topology, placement, access))

    def _fits(self, index: int, mode: Mode) -> bool:
        """Whether a shard fits an empty rank (else recorded as rejected, with the reason)."""
        t, reason = mode.terms, ""
        if t.device_memory_bytes > self.device_limit:
            reason = f"{gb(t.device_memory_bytes)} > {gb(self.device_limit)} device memory"
        elif t.host_memory_bytes > self.host_limit:
            reason = f"{gb(t.host_memory_bytes)} > {gb(self.host_limit)} host memory"
        if reason:
            self._reject(index, mode, reason)
        return not reason

    def _reject(self, index: int, mode: Mode, reason: str) -> None:
        self.rejects[index].append(Candidate(mode, (), math.inf, math.inf, reason=reason))

    def _least_memory(self, groups: list[Group]) -> tuple[float, float]:
        """(device, host) bytes over all ranks of the table's mode using least device memory."""
        needs = [
            (
                m.terms.device_memory_bytes * m.placement.shards,
                m.terms.host_memory_bytes * m.placement.shards,
            )
            for g in groups
            for m in g.modes
        ]
        return min(needs, default=(0.0, 0.0))

    def _least_work(self, groups: list[Group]) -> float:
        """A quick estimate of the least rank time a table adds (summed over ranks, as in
        `State.score`), to order the greedy and bound the work still to place."""
        base = all_reduce_s(self.dense_bytes, self.topology)
        pair_mean = float(self.pair_s.mean())
        best = math.inf
        for g in groups:
            owners = self.world if g.sharding == DATA_PARALLEL else g.shards
            links = (g.ids + 2 * g.emb) * owners * pair_mean
            for mode in g.modes:
                t = mode.terms
                compute = self.dense_s + t.lookup_s
                exposed = expose_staging(compute, *t.staging_parts)
                reduce = (  # (a sharded table's all-reduce adds nothing to the dense part's)
                    all_reduce_s(self.dense_bytes + t.all_reduce_bytes, self.topology) - base
                    if t.all_reduce_bytes
                    else 0.0
                )
                best = min(best, owners * (t.lookup_s + exposed) + links + self.world * reduce)
        return 0.0 if math.isinf(best) else best


# The all-to-all templates of `Problem.units`: the `RankTerms.traffic` rows of each rank per
# byte of ids and of embeddings a consumer exchanges with a shard (`ranks.traffic_units`), for
# a table with a shard on every rank; table-wise, the others' with the owner on their node or
# not, and the owner's; table-row-wise, each rank's as an owner and as a consumer.
EVERYONE, NEAR, FAR, ALONE, NODE_OWNER, NODE_CONSUMER = range(6)


def _traffic_templates(p: Problem, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """([8, N, W] the traffic units of a table-row-wise table on each node, [8, 6, W] the
    templates)."""
    W = topology.world_size
    nodes = traffic_units(p.same_node, topology, reduced=True)
    units = np.zeros((8, 6, W))
    units[:, EVERYONE] = traffic_units(np.ones(W), topology, reduced=False)
    units[[0, 6], NEAR] = 1.0  # ids sent, outputs received over NVLink
    units[[1, 7], FAR] = 1.0  # over the NIC
    alone = np.broadcast_arrays(0.0, 0.0, p.node_size - 1.0, W - p.node_size)  # all consume
    units[:, ALONE] = np.stack([*alone, *alone[2:], *alone[:2]])
    if p.nodes > 1:  # a rank's units depend only on whether its node holds the table
        ranks = np.arange(W)
        units[:, NODE_OWNER] = nodes[:, p.node, ranks]
        units[:, NODE_CONSUMER] = nodes[:, (p.node + 1) % p.nodes, ranks]
    return nodes, units


# The layouts that spread a table's shards over several ranks (more than one, each its part).
SPREAD = (ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE)


def kind_text(sharding: str, shards: int, storage: str) -> str:
    where = f"{sharding} x{shards}" if sharding in SPREAD else sharding
    return f"{where} {'device' if storage == DEVICE else 'host + cache'}"


def gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB"


class Group:
    """Modes of one table sharing a layout (sharding and shard count), as [M, 1] columns."""

    def __init__(self, modes: list[Mode]):
        self.modes = modes
        self.sharding, self.shards = modes[0].placement.sharding, modes[0].placement.shards
        t = [m.terms for m in modes]
        columns = np.array(  # [5, M, 1]
            [(x.lookup_s, *x.staging_parts, x.device_memory_bytes, x.host_memory_bytes) for x in t],
            dtype=np.float64,
        ).T[:, :, None]
        self.lookup, self.overlapped, self.exposed, self.device, self.host = columns
        # The same for every mode of a layout:
        self.ids, self.emb = t[0].ids_bytes_per_peer, t[0].embedding_bytes_per_peer
