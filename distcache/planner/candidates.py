"""The solver's menu: every way each table may be placed (`Mode`: sharding, shard count,
storage, cache size, look-ahead), priced per shard once, before any search.

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
from typing import TYPE_CHECKING

import numpy as np

from distcache.cache.config import HOT_ALL
from distcache.planner.dense import all_reduce_s, dense_compute_s, dense_parameter_bytes
from distcache.planner.ranks import expose_staging, node_layout
from distcache.planner.shards import ShardTerms, shard_access, shard_terms
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    HOST_CACHED,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)

if TYPE_CHECKING:  # the options are defined with the solver's entry, which imports this file
    from distcache.planner.solver import SolverOptions

TIE_S = 1e-10  # seconds: step times closer than this are equal


@dataclass(frozen=True)
class Mode:
    """One way to place a table, priced per shard (ranks chosen later)."""

    sharding: str
    shards: int
    storage: str
    cache_fraction: float
    lookahead: int
    prefetch_depth: int
    terms: ShardTerms
    hot_rows: int = 0
    hot_reduce: str = HOT_ALL

    def describe(self, ranks: tuple[int, ...] = ()) -> str:
        where = {
            DATA_PARALLEL: "data_parallel",
            TABLE_WISE: f"table_wise on rank {ranks[0]}" if ranks else "table_wise",
            ROW_WISE: f"row_wise on {self.shards} ranks",
            COLUMN_WISE: f"column_wise on {self.shards} ranks"
            + (f" {list(ranks)}" if ranks else ""),
            TABLE_ROW_WISE: f"table_row_wise on {self.shards} ranks"
            + (f" {list(ranks)}" if ranks else ""),
        }[self.sharding]
        hot = f", {self.hot_rows} hot rows replicated" if self.hot_rows else ""
        if self.hot_rows and self.hot_reduce != HOT_ALL:
            hot += " (touched rows all-gathered)"
        if self.storage == DEVICE:
            return f"{where}, device{hot}"
        return (
            f"{where}, host + {100 * self.cache_fraction:.3g}% cache, L={self.lookahead} "
            f"K={self.prefetch_depth}{hot}"
        )

    def key(self) -> tuple:
        return (
            self.sharding,
            self.shards,
            self.storage,
            self.cache_fraction,
            self.lookahead,
            self.prefetch_depth,
            self.hot_rows,
            self.hot_reduce,
        )

    def table_plan(self, table: str, ranks: tuple[int, ...]) -> TablePlan:
        return TablePlan(
            table=table,
            sharding=self.sharding,
            ranks=ranks,
            storage=self.storage,
            cache_fraction=self.cache_fraction if self.storage == HOST_CACHED else 1.0,
            lookahead=self.lookahead,
            prefetch_depth=self.prefetch_depth,
            hot_rows=self.hot_rows,
            hot_reduce=self.hot_reduce,
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
        self.node, self.node_starts, self.node_size = node_layout(topology)
        self.nodes = len(self.node_starts)
        self.same_node = (self.node[None, :] == np.arange(self.nodes)[:, None]).astype(float)
        self.device_limit = topology.device_memory_bytes
        self.host_limit = topology.host_memory_bytes
        # [W] seconds per byte a shard on each rank exchanges with every other rank (work).
        self.pair_s = (self.node_size - 1) / topology.intra_node_bw_bytes_per_s + (
            W - self.node_size
        ) / topology.inter_node_bw_bytes_per_s
        self.tables = workload.tables
        self.rejects: list[list[Candidate]] = [[] for _ in workload.tables]
        self.groups = [self._groups(i, t) for i, t in enumerate(workload.tables)]
        self.work = [self._least_work(g) for g in self.groups]
        self.least_memory = [self._least_memory(g) for g in self.groups]
        # Each table's modes by (sharding, shards, storage, fraction, L, K), to reuse for seeds.
        self.known = [{m.key(): m for g in groups for m in g.modes} for groups in self.groups]

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
        if DEVICE in opts.storages or sharding == DATA_PARALLEL:
            modes.append(self.mode(table, sharding, shards, (DEVICE, 1.0, 0, 0)))
        if HOST_CACHED not in opts.storages or sharding == DATA_PARALLEL:
            return modes
        rows, _, unique = shard_access(
            table, self.workload, self.topology, sharding=sharding, shards=shards
        )
        for L, K in opts.lookahead_pairs():
            too_small = None
            for fraction in sorted(set(opts.cache_fractions)):
                cache = (HOST_CACHED, fraction, L, K)
                if math.ceil(fraction * rows) < math.ceil((K + 1) * unique - 1e-9):
                    too_small = cache  # cheaper to skip here than to price and reject
                    continue
                if math.ceil(fraction * rows) >= rows and DEVICE in opts.storages:
                    break  # a cache of every row: device storage without the metadata
                modes.append(self.mode(table, sharding, shards, cache))
            if too_small is not None:
                reason = (
                    f"a cache of {100 * too_small[1]:.3g}% or less holds fewer than the "
                    f"{math.ceil((K + 1) * unique)} rows of {K + 1} batches in flight"
                )
                self._reject(index, self.mode(table, sharding, shards, too_small), reason)
        return modes

    def mode(self, table: TableStats, sharding: str, shards: int, cache: tuple) -> Mode:
        storage, fraction, lookahead, depth = cache
        terms = shard_terms(
            table,
            self.workload,
            self.topology,
            sharding=sharding,
            shards=shards,
            storage=storage,
            cache_fraction=fraction,
            lookahead=lookahead,
            prefetch_depth=depth,
        )
        return Mode(sharding, shards, storage, fraction, lookahead, depth, terms)

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
            (m.terms.device_memory_bytes * m.shards, m.terms.host_memory_bytes * m.shards)
            for g in groups
            for m in g.modes
        ]
        return min(needs, default=(0.0, 0.0))

    def _least_work(self, groups: list[Group]) -> float:
        """A quick estimate of the least rank time a table adds (summed over ranks, as in
        `State.score`), to order the greedy and bound the work still to place."""
        base = all_reduce_s(self.dense_bytes, self.topology)
        best = math.inf
        for g in groups:
            owners = self.world if g.sharding == DATA_PARALLEL else g.shards
            links = (g.ids + 2 * g.emb) * owners * float(self.pair_s.mean())
            for m, mode in enumerate(g.modes):
                t = mode.terms
                compute = self.dense_s + t.lookup_s
                exposed = expose_staging(compute, g.overlapped[m, 0], g.exposed[m, 0])
                reduce = all_reduce_s(self.dense_bytes + t.all_reduce_bytes, self.topology) - base
                best = min(best, owners * (t.lookup_s + exposed) + links + self.world * reduce)
        return 0.0 if math.isinf(best) else best


def kind_text(sharding: str, shards: int, storage: str) -> str:
    spread = (ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE)
    where = f"{sharding} x{shards}" if sharding in spread else sharding
    return f"{where} {'device' if storage == DEVICE else 'host + cache'}"


def gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB"


class Group:
    """Modes of one table sharing a layout (sharding and shard count), as [M, 1] columns."""

    def __init__(self, modes: list[Mode]):
        self.modes = modes
        self.sharding, self.shards = modes[0].sharding, modes[0].shards
        t = [m.terms for m in modes]
        columns = np.array(
            [(x.lookup_s, x.staging_s, x.device_memory_bytes, x.host_memory_bytes) for x in t]
        ).T[:, :, None]  # [4, M, 1]
        self.lookup, staging, self.device, self.host = columns
        overlapped = np.array([x.staging_overlapped for x in t])[:, None]
        self.overlapped = np.where(overlapped, staging, 0.0)
        self.exposed = np.where(overlapped, 0.0, staging)
        # The same for every mode of a layout:
        self.ids, self.emb = t[0].ids_bytes_per_peer, t[0].embedding_bytes_per_peer
