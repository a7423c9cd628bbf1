"""The throughput solver: per table a placement, storage, cache size and look-ahead, balanced
over ranks, minimizing the modelled step time (the slowest rank's) under the memory limits.

Every cost comes from `cost.py`, on the per-rank term arrays `plan_cost` uses; a state is
judged by (step, work), work being the rank time summed over ranks (see `_State`).

1. Menu: per table, every allowed mode — data parallel; table-wise, row-wise (all ranks),
   column-wise (S ranks, S dividing the dim) — with device storage or a host store plus a
   cache of each allowed fraction and (L, K), priced per shard. Modes whose shard cannot fit
   an empty rank, or whose cache is smaller than its in-flight working set, are rejected
   (and reported in the explanations).
2. Greedy, longest processing time first: tables by decreasing least work; each takes the
   mode and ranks minimizing the estimated final step max(step after placing it, (work
   placed + least work still to place) / ranks) — a table spreads over ranks only when it
   would otherwise become the bottleneck — then the least work, then the least staging
   traffic (device storage when a cache buys nothing). Candidates must leave enough memory,
   summed over ranks, for the least memory of the tables still to place. Table-wise is
   priced on every rank at once; column-wise shards go to the S ranks where they cost least.
   When memory binds (caches were needed), three more passes run: ties broken toward less
   device memory, memory first (largest tables first, least memory each), and the smallest
   tables first (for time: the small tables fill the device, the large ones get the caches).
3. Local search until no move helps or the move budget (`SolverOptions.max_moves`, tried
   moves over all starts) is spent: re-place one of the tables that load the slowest rank, or
   two tables together (a swap); a move is kept if it lowers the step, or keeps it and lowers
   the work. The budget counts moves, not seconds, so the same inputs give the same plan
   whatever the machine's load; a wall-time limit (`time_limit_s`) only guards against a
   runaway search, far above a normal run.
4. More starts, improved the same way: the uniform device baselines (`uniform_plan`), so the
   result is never worse than a fitting baseline; and, when each sharding type a plan uses
   costs at least 1 % of the step (`cost.global_terms`: latencies, CPU overheads), the greedy
   restricted to one sharding type, which single moves cannot reach. The best plan wins.
5. Explanations: per table, the chosen placement and the best placement of every other kind
   with the step the plan would have, or why it does not fit.

On 3 tables and 2 ranks the result equals a brute-force search over every placement
(tests/unit/planner/test_solver.py).

Example::

    plan = solve(workload_preset("criteo-terabyte"), preset("h100", world_size=8))
    print(plan.explanations["t0"])
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from distcache.cache.config import DEFAULT_LOOKAHEAD
from distcache.errors import DistcacheConfigError
from distcache.planner import cost as C
from distcache.planner.cost import ShardTerms, shard_terms
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    HOST_CACHED,
    ROW_WISE,
    SHARDING_TYPES,
    STORAGES,
    TABLE_WISE,
    Plan,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)

log = logging.getLogger(__name__)

_TIE = 1e-10  # seconds: step times closer than this are equal
_RTOL = 1e-5  # relative: estimated steps closer than this are equal when picking a candidate


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """What `solve` may choose from, and how far it may search."""

    shardings: tuple[str, ...] = SHARDING_TYPES
    """Allowed sharding types."""
    storages: tuple[str, ...] = STORAGES
    """Allowed storages for sharded tables (data parallel is always on the device)."""
    cache_fractions: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
    """Cache sizes tried for host-cached shards, as fractions of the shard's rows."""
    lookaheads: tuple[int, ...] = (DEFAULT_LOOKAHEAD,)
    """Look-ahead depths L tried for caches; 0 is a reactive (LRU) cache."""
    prefetch_depths: tuple[int, ...] = (1,)
    """Prefetch depths K tried with each L (pairs with K > L are skipped; L = 0 uses K = 0)."""
    column_wise_shards: tuple[int, ...] = (2, 4)
    """Shard counts tried for column-wise tables (those dividing the dim, at most the ranks)."""
    max_moves: int = 1000
    """Local-search moves tried over all starts (the best start gets twice the others' share).
    A budget of moves, not seconds, keeps the plan deterministic; the search often stops
    earlier, when no move helps (1000 synthetic tables on 128 H100s: ~500 moves, ~1.5 s).
    0: greedy only."""
    time_limit_s: float = 120.0
    """Safety limit on the local search's wall time, far above a normal run (1000 tables on
    128 ranks: ~1.5 s of search, ~5 s in all on 2 shared CPU cores). Only a runaway search
    reaches it; the plan then depends on the machine's speed, and a warning says so."""
    explain: bool = True
    """Fill `Plan.explanations` (one more pass over the tables)."""

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise DistcacheConfigError(f"SolverOptions: {message}")

        bad = [s for s in self.shardings if s not in SHARDING_TYPES]
        check(self.shardings and not bad, f"shardings {bad or '()'} not in {SHARDING_TYPES}")
        bad = [s for s in self.storages if s not in STORAGES]
        check(self.storages and not bad, f"storages {bad or '()'} not in {STORAGES}")
        check(
            all(0 < f <= 1 for f in self.cache_fractions),
            f"cache_fractions must lie in (0, 1], got {self.cache_fractions}",
        )
        check(
            HOST_CACHED not in self.storages or bool(self.cache_fractions),
            "host_cached storage needs at least one cache fraction",
        )
        check(all(v >= 0 for v in self.lookaheads), f"lookaheads must be >= 0: {self.lookaheads}")
        check(
            bool(self.lookaheads) and bool(self.prefetch_depths),
            "lookaheads and prefetch_depths must not be empty",
        )
        check(
            all(v >= 0 for v in self.prefetch_depths),
            f"prefetch_depths must be >= 0: {self.prefetch_depths}",
        )
        check(
            all(s >= 2 for s in self.column_wise_shards),
            f"column_wise_shards must be >= 2: {self.column_wise_shards}",
        )
        check(self.max_moves >= 0, f"max_moves must be >= 0, got {self.max_moves}")
        check(self.time_limit_s > 0, f"time_limit_s must be > 0, got {self.time_limit_s}")

    def lookahead_pairs(self) -> tuple[tuple[int, int], ...]:
        """The (L, K) pairs tried for caches."""
        pairs = {(L, K) for L in self.lookaheads for K in self.prefetch_depths if K <= L}
        pairs |= {(0, 0) for L in self.lookaheads if L == 0}
        return tuple(sorted(pairs))


@dataclass(frozen=True)
class _Mode:
    """One way to place a table, priced per shard (ranks chosen later)."""

    sharding: str
    shards: int
    storage: str
    cache_fraction: float
    lookahead: int
    prefetch_depth: int
    terms: ShardTerms

    def describe(self, ranks: tuple[int, ...] = ()) -> str:
        where = {
            DATA_PARALLEL: "data_parallel",
            TABLE_WISE: f"table_wise on rank {ranks[0]}" if ranks else "table_wise",
            ROW_WISE: f"row_wise on {self.shards} ranks",
            COLUMN_WISE: f"column_wise on {self.shards} ranks"
            + (f" {list(ranks)}" if ranks else ""),
        }[self.sharding]
        if self.storage == DEVICE:
            return f"{where}, device"
        return (
            f"{where}, host + {100 * self.cache_fraction:.3g}% cache, L={self.lookahead} "
            f"K={self.prefetch_depth}"
        )

    def key(self) -> tuple:
        return (
            self.sharding,
            self.shards,
            self.storage,
            self.cache_fraction,
            self.lookahead,
            self.prefetch_depth,
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
        )


@dataclass
class _Candidate:
    """A mode with its best ranks on the current state and what it does to the step."""

    mode: _Mode
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


class _Problem:
    """The workload and topology, the constants every evaluation needs, and each table's menu
    of modes grouped by layout."""

    def __init__(self, workload: Workload, topology: Topology, options: SolverOptions):
        self.workload, self.topology, self.options = workload, topology, options
        self.world = W = topology.world_size
        self.dense_s = C.dense_compute_s(workload, topology)
        self.dense_bytes = C.dense_parameter_bytes(workload)
        self.node, self.node_starts, self.node_size = C.node_layout(topology)
        self.nodes = len(self.node_starts)
        self.same_node = (self.node[None, :] == np.arange(self.nodes)[:, None]).astype(float)
        self.device_limit = topology.device_memory_bytes
        self.host_limit = topology.host_memory_bytes
        # [W] seconds per byte a shard on each rank exchanges with every other rank (work).
        self.pair_s = (self.node_size - 1) / topology.intra_node_bw_bytes_per_s + (
            W - self.node_size
        ) / topology.inter_node_bw_bytes_per_s
        self.tables = workload.tables
        self.rejects: list[list[_Candidate]] = [[] for _ in workload.tables]
        self.groups = [self._groups(i, t) for i, t in enumerate(workload.tables)]
        self.work = [self._least_work(g) for g in self.groups]
        self.least_memory = [self._least_memory(g) for g in self.groups]
        # Each table's modes by (sharding, shards, storage, fraction, L, K), to reuse for seeds.
        self.known = [{m.key(): m for g in groups for m in g.modes} for groups in self.groups]

    def _groups(self, index: int, table: TableStats) -> list[_Group]:
        opts, layouts = self.options, []
        if DATA_PARALLEL in opts.shardings:
            layouts.append((DATA_PARALLEL, self.world))
        if TABLE_WISE in opts.shardings:
            layouts.append((TABLE_WISE, 1))
        if ROW_WISE in opts.shardings and self.world > 1:
            layouts.append((ROW_WISE, self.world))
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
                groups.append(_Group(modes))
        return groups

    def _layout_modes(
        self, index: int, table: TableStats, sharding: str, shards: int
    ) -> list[_Mode]:
        opts = self.options
        modes = []
        if DEVICE in opts.storages or sharding == DATA_PARALLEL:
            modes.append(self.mode(table, sharding, shards, (DEVICE, 1.0, 0, 0)))
        if HOST_CACHED not in opts.storages or sharding == DATA_PARALLEL:
            return modes
        rows, _, unique = C.shard_access(
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

    def mode(self, table: TableStats, sharding: str, shards: int, cache: tuple) -> _Mode:
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
        return _Mode(sharding, shards, storage, fraction, lookahead, depth, terms)

    def _fits(self, index: int, mode: _Mode) -> bool:
        """Whether a shard fits an empty rank (else recorded as rejected, with the reason)."""
        t, reason = mode.terms, ""
        if t.device_memory_bytes > self.device_limit:
            reason = f"{_gb(t.device_memory_bytes)} > {_gb(self.device_limit)} device memory"
        elif t.host_memory_bytes > self.host_limit:
            reason = f"{_gb(t.host_memory_bytes)} > {_gb(self.host_limit)} host memory"
        if reason:
            self._reject(index, mode, reason)
        return not reason

    def _reject(self, index: int, mode: _Mode, reason: str) -> None:
        self.rejects[index].append(_Candidate(mode, (), math.inf, math.inf, reason=reason))

    def _least_memory(self, groups: list[_Group]) -> tuple[float, float]:
        """(device, host) bytes over all ranks of the table's mode using least device memory."""
        needs = [
            (m.terms.device_memory_bytes * m.shards, m.terms.host_memory_bytes * m.shards)
            for g in groups
            for m in g.modes
        ]
        return min(needs, default=(0.0, 0.0))

    def _least_work(self, groups: list[_Group]) -> float:
        """A quick estimate of the least rank time a table adds (summed over ranks, as in
        `_State.score`), to order the greedy and bound the work still to place."""
        base = C.all_reduce_s(self.dense_bytes, self.topology)
        best = math.inf
        for g in groups:
            owners = self.world if g.sharding == DATA_PARALLEL else g.shards
            links = (g.ids + 2 * g.emb) * owners * float(self.pair_s.mean())
            for m, mode in enumerate(g.modes):
                t = mode.terms
                exposed = max(g.overlapped[m, 0] - self.dense_s - t.lookup_s, 0.0) + g.exposed[m, 0]
                reduce = C.all_reduce_s(self.dense_bytes + t.all_reduce_bytes, self.topology) - base
                best = min(best, owners * (t.lookup_s + exposed) + links + self.world * reduce)
        return 0.0 if math.isinf(best) else best


def _kind(sharding: str, shards: int, storage: str) -> str:
    where = f"{sharding} x{shards}" if sharding in (ROW_WISE, COLUMN_WISE) else sharding
    return f"{where} {'device' if storage == DEVICE else 'host + cache'}"


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB"


class _Group:
    """Modes of one table sharing a layout (sharding and shard count), as [M, 1] columns."""

    def __init__(self, modes: list[_Mode]):
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


class _State:
    """Accumulated rank terms (`cost.RANK_TERMS`) of the tables placed so far.

    A state is judged by (step, work): the slowest rank's step, exactly as `plan_cost` prices
    it, and the rank time summed over ranks with all-to-all bytes counted linearly (half at the
    sender, half at the receiver). Taking the busier direction per rank, as the step does,
    would make a lone table-wise shard look twice as costly as it is once ranks both send and
    receive, and steer the greedy away from table-wise early on.
    """

    def __init__(self, problem: _Problem):
        self.p = problem
        self.load = np.zeros((len(C.RANK_TERMS), problem.world))
        self.dp_bytes = 0.0
        self.kinds: Counter[str] = Counter()  # tables placed per sharding type
        self.sent_ids = 0.0  # ids each rank sends per step
        self.link_work_s = 0.0
        self.placed: list[tuple[_Mode, tuple[int, ...]] | None] = [None] * len(problem.tables)
        self.contrib: list[np.ndarray | None] = [None] * len(problem.tables)

    def constant_s(self, mode: _Mode | None = None) -> float:
        """What every rank pays alike (all-reduce, all-to-all latencies, per-sharding-type
        overheads) if `mode` were added."""
        dp = self.dp_bytes + (mode.terms.all_reduce_bytes if mode else 0.0)
        sent = self.sent_ids + (C.sent_ids_per_rank(mode.terms, mode.shards) if mode else 0.0)
        kinds = {k for k, n in self.kinds.items() if n > 0}
        kinds |= {mode.sharding} if mode is not None else set()
        return C.global_terms(self.p.workload, self.p.topology, dp, kinds, sent).shared_s

    def core(self) -> np.ndarray:
        """[W] compute and exposed staging per rank."""
        compute = self.p.dense_s + self.load[C.LOOKUP]
        return compute + np.maximum(self.load[C.OVERLAPPED] - compute, 0.0) + self.load[C.EXPOSED]

    def totals(self) -> np.ndarray:
        """[W] step per rank, as `plan_cost` prices it."""
        return C.rank_totals(
            self.load,
            dense_s=self.p.dense_s,
            global_s=self.constant_s(),
            latency_s=0.0,
            topology=self.p.topology,
        )

    def add(
        self, index: int, mode: _Mode, ranks: tuple[int, ...], contrib: np.ndarray | None = None
    ) -> None:
        """Place table `index` (`contrib`: its rank terms, if known from an earlier `remove`)."""
        if contrib is None:
            contrib = C.shard_contribution(mode.terms, ranks, self.p.topology)
        self.load += contrib
        self.dp_bytes += mode.terms.all_reduce_bytes
        self.kinds[mode.sharding] += 1
        self.sent_ids += C.sent_ids_per_rank(mode.terms, mode.shards)
        self.link_work_s += _link_work(mode.terms, self.p.pair_s[list(ranks)].sum())
        self.placed[index], self.contrib[index] = (mode, ranks), contrib

    def remove(self, index: int) -> tuple[_Mode, tuple[int, ...], np.ndarray]:
        """Take table `index` out; returns what `add` needs to put it back."""
        (mode, ranks), contrib = self.placed[index], self.contrib[index]
        self.load -= contrib
        self.dp_bytes -= mode.terms.all_reduce_bytes
        self.kinds[mode.sharding] -= 1
        self.sent_ids -= C.sent_ids_per_rank(mode.terms, mode.shards)
        self.link_work_s -= _link_work(mode.terms, self.p.pair_s[list(ranks)].sum())
        self.placed[index] = self.contrib[index] = None
        return mode, ranks, contrib

    def score(self) -> tuple[float, float]:
        """(step, work): see the class docstring."""
        work = self.core().sum() + self.link_work_s + self.p.world * self.constant_s()
        return float(self.totals().max()), float(work)

    def fits(self) -> bool:
        return bool(
            (self.load[C.DEVICE_MEMORY] <= self.p.device_limit).all()
            and (self.load[C.HOST_MEMORY] <= self.p.host_limit).all()
        )

    def plan(self, name: str, explanations: dict[str, str]) -> Plan:
        tables = tuple(
            mode.table_plan(t.name, ranks)
            for t, (mode, ranks) in zip(self.p.tables, self.placed, strict=True)
        )
        return Plan(name=name, tables=tables, explanations=explanations)


def _link_work(terms: ShardTerms, pair_s: float) -> float:
    """All-to-all seconds of a table summed over ranks, bytes counted linearly: `pair_s` is
    the sum over its shards of the seconds per byte exchanged with every other rank."""
    return (terms.ids_bytes_per_peer + 2 * terms.embedding_bytes_per_peer) * pair_s


# ---------------------------------------------------------------------------------------------
# Pricing every mode of one table against the current state. The step per rank is split as in
# `cost.rank_totals` (compute + exposed staging, all-to-alls, shared terms), each part computed
# at the shape it varies with.
# ---------------------------------------------------------------------------------------------


def _evaluate(
    state: _State,
    index: int,
    enough: Callable[[_Candidate], bool] | None = None,
    kinds: Collection[str] | None = None,
) -> list[_Candidate]:
    """Every mode of table `index` at its best ranks (only sharding types in `kinds`, if
    given). With `enough`, stop after data parallel and table-wise when a table-wise
    candidate satisfies it: row- and column-wise move more bytes than table-wise for the same
    lookups, so they only help a table that would be the bottleneck."""
    out: list[_Candidate] = []
    for group in state.p.groups[index]:  # data parallel, table-wise, then the others
        if kinds is not None and group.sharding not in kinds:
            continue
        if group.sharding in (ROW_WISE, COLUMN_WISE) and enough is not None:
            if any(c.fits and c.mode.sharding == TABLE_WISE and enough(c) for c in out):
                break
            enough = None  # decided: the spread layouts are priced
        if group.sharding == TABLE_WISE:
            out += _evaluate_table_wise(state, group)
        elif group.sharding == COLUMN_WISE:
            out += _evaluate_column_wise(state, group)
        else:
            out += _evaluate_everywhere(state, group)
    return out


def _links_s(state: _State, ids: tuple, emb: tuple) -> np.ndarray:
    """Both all-to-alls' time per rank with extra bytes (sent intra, sent inter, received
    intra, received inter) of ids and of embeddings; the output one runs twice (fwd, bwd)."""
    L, topology = state.load, state.p.topology
    ids_s = C.a2a_time_s(*(L[C.IDS_SI + i] + ids[i] for i in range(4)), topology)
    emb_s = C.a2a_time_s(*(L[C.EMB_SI + i] + emb[i] for i in range(4)), topology)
    return ids_s + 2 * emb_s


def _core(state: _State, group: _Group, owner: np.ndarray | float) -> np.ndarray:
    """[M, W] compute + exposed staging per rank with the group's shards where `owner` is 1."""
    L = state.load
    compute = state.p.dense_s + L[C.LOOKUP] + group.lookup * owner
    staged = L[C.OVERLAPPED] + group.overlapped * owner
    return compute + np.maximum(staged - compute, 0.0) + L[C.EXPOSED] + group.exposed * owner


def _memory_ok(state: _State, group: _Group) -> np.ndarray:
    """[M, W]: whether one more shard of each mode fits each rank."""
    L, p = state.load, state.p
    return (L[C.DEVICE_MEMORY] + group.device <= p.device_limit) & (
        L[C.HOST_MEMORY] + group.host <= p.host_limit
    )


def _owner_step(state: _State, group: _Group) -> tuple[np.ndarray, np.ndarray]:
    """([M, W] core, [M, W] step) of each rank if it alone held one shard of each mode."""
    p = state.p
    local, remote = p.node_size - 1.0, p.world - p.node_size
    i, e = group.ids, group.emb
    links = _links_s(state, (0, 0, i * local, i * remote), (e * local, e * remote, 0, 0))
    core = _core(state, group, 1.0)
    return core, core + links + state.constant_s(group.modes[0])


def _spread(state: _State, group: _Group, is_owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([M, W] step per rank, [M] work) with the group's shards where `is_owner` [M, W] is 1."""
    mine, theirs, local, remote = C.peer_counts(is_owner, state.p.topology)
    i, e = group.ids, group.emb
    links = _links_s(
        state,
        (i * mine, i * theirs, i * local, i * remote),
        (e * local, e * remote, e * mine, e * theirs),
    )
    core = _core(state, group, is_owner)
    const = state.constant_s(group.modes[0])
    pair_s = is_owner @ state.p.pair_s  # [M]
    work = core.sum(axis=-1) + state.link_work_s + (i + 2 * e) * pair_s + state.p.world * const
    return core + links + const, work


def _evaluate_table_wise(state: _State, group: _Group) -> list[_Candidate]:
    """Each mode on every rank at once: the owner's step from `_owner_step`, every other
    rank's from the consumer terms, which depend only on the owner's node."""
    p, W = state.p, state.p.world
    i, e, same, other = group.ids, group.emb, p.same_node, 1 - p.same_node  # [N, W]
    consumers = _links_s(state, (i * same, i * other, 0, 0), (0, 0, e * same, e * other))
    core0, const = state.core(), state.constant_s(group.modes[0])
    others = core0 + consumers + const  # [N, W] step of each rank when the owner is on node n
    core, owner = _owner_step(state, group)  # [M, W]
    ok = _memory_ok(state, group)
    ranks = np.arange(W)
    order = np.argsort(others, axis=1)
    first = others[np.arange(p.nodes), order[:, -1]]
    second = others[np.arange(p.nodes), order[:, -2]] if W > 1 else np.full(p.nodes, -np.inf)
    rest_max = np.where(order[p.node, -1] == ranks, second[p.node], first[p.node])  # [W]
    step = np.where(ok, np.maximum(owner, rest_max), np.inf)
    work = core0.sum() - core0 + core + state.link_work_s + (i + 2 * e) * p.pair_s + W * const
    best = np.lexsort((owner, np.round(work / _TIE), np.round(step / _TIE)), axis=-1)[:, 0]
    return [
        _Candidate(mode, (int(r),), float(step[m, r]), float(work[m, r]))
        if ok[m, r]
        else _no_room(state, mode)
        for m, (mode, r) in enumerate(zip(group.modes, best, strict=True))
    ]


def _evaluate_everywhere(state: _State, group: _Group) -> list[_Candidate]:
    """Data parallel and row-wise: a shard on every rank."""
    p = state.p
    totals, work = _spread(state, group, np.ones((1, p.world)))  # [M, W], [M]
    ok = _memory_ok(state, group).all(axis=-1)
    everyone = tuple(range(p.world))
    return [
        _Candidate(mode, everyone, float(totals[m].max()), float(work[m]))
        if ok[m]
        else _no_room(state, mode)
        for m, mode in enumerate(group.modes)
    ]


def _evaluate_column_wise(state: _State, group: _Group) -> list[_Candidate]:
    """Shards go to the S ranks where one shard alone would cost least; then priced exactly."""
    p, shards = state.p, group.shards
    _, owner = _owner_step(state, group)
    ok = _memory_ok(state, group)  # [M, W]
    chosen = np.lexsort((owner, ~ok), axis=-1)[:, :shards]  # [M, S] cheapest fitting ranks
    is_owner = np.zeros((len(group.modes), p.world))
    np.put_along_axis(is_owner, chosen, 1.0, axis=-1)
    totals, work = _spread(state, group, is_owner)
    return [
        _Candidate(
            mode,
            tuple(sorted(int(r) for r in chosen[m])),
            float(totals[m].max()),
            float(work[m]),
        )
        if ok[m].sum() >= shards
        else _no_room(state, mode)
        for m, mode in enumerate(group.modes)
    ]


def _no_room(state: _State, mode: _Mode) -> _Candidate:
    """A candidate that does not fit, saying which memory is short on its ranks."""
    t, p = mode.terms, state.p
    needed = p.world if mode.sharding in (DATA_PARALLEL, ROW_WISE) else mode.shards
    reason = f"no {needed} rank(s) with room for a shard"
    for kind, row, need, limit in (
        ("device", C.DEVICE_MEMORY, t.device_memory_bytes, p.device_limit),
        ("host", C.HOST_MEMORY, t.host_memory_bytes, p.host_limit),
    ):
        free = np.sort(limit - state.load[row])[-needed]  # the needed-th most free rank's
        if need > free:
            reason = f"needs {_gb(need)} {kind} memory per shard, {_gb(max(free, 0))} free"
            break
    return _Candidate(mode, (), math.inf, math.inf, reason=reason)


def _pick(
    candidates: list[_Candidate],
    remaining_s: float,
    world: int,
    prefer: str,
    allowed: Callable[[_Candidate], bool] | None = None,
) -> _Candidate | None:
    """The fitting (and `allowed`) candidate minimizing the estimated final step, then the
    added work, then staging traffic (`prefer` 'time'), or device memory ('time_memory'), or
    minimizing device memory first ('memory'). When no fitting candidate is allowed, the one
    using the least device memory."""
    fitting = [c for c in candidates if c.fits]
    permitted = [c for c in fitting if allowed is None or allowed(c)]
    if fitting and not permitted:
        return min(fitting, key=lambda c: (_memory(c), c.step_s))
    if not permitted:
        return None
    for c in permitted:
        c.estimate_s = max(c.step_s, (c.work_s + remaining_s) / world)
    # Estimates within 0.001 % tie: a table that nudges every rank by nanoseconds (a tiny
    # data-parallel table) should not lose to one that adds far more work elsewhere.
    if prefer == "memory":
        least = min(_memory(c) for c in permitted)
        permitted = [c for c in permitted if _memory(c) <= least]
    cutoff = min(c.estimate_s for c in permitted) * (1 + _RTOL) + _TIE
    near = [c for c in permitted if c.estimate_s <= cutoff]

    def key(c: _Candidate) -> tuple:
        staging = c.mode.terms.staging_bytes_per_step * c.mode.shards
        tail = (_memory(c), staging) if prefer == "time_memory" else (staging, _memory(c))
        return (round(c.work_s / _TIE), *tail, c.estimate_s)

    return min(near, key=key)


def _memory(c: _Candidate) -> float:
    """Device bytes a candidate takes over all its ranks."""
    return c.mode.terms.device_memory_bytes * c.mode.shards


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------


def _greedy(problem: _Problem, prefer: str, kinds: Collection[str] | None = None) -> _State:
    """Tables by decreasing least work (least memory with `prefer` 'memory'; smallest whole
    table first with 'small_first', which then picks as 'time': the small tables take the device
    memory, the large ones the caches), each at the candidate `_pick` prefers among those that
    leave enough memory, summed over ranks, for the least memory of the tables left; only
    sharding types in `kinds`, if given."""
    state, world = _State(problem), problem.world
    tables = range(len(problem.tables))
    if prefer == "memory":
        order = sorted(tables, key=lambda i: -problem.least_memory[i][0])
    elif prefer == "small_first":
        workload = problem.workload
        order = sorted(tables, key=lambda i: problem.tables[i].rows * workload.row_bytes(
            problem.tables[i]))  # fmt: skip
        prefer = "time"
    else:
        order = sorted(tables, key=lambda i: -problem.work[i])
    remaining = sum(problem.work)
    reserved = np.array(problem.least_memory, dtype=np.float64).sum(axis=0)  # (device, host)
    limits = np.array([problem.device_limit, problem.host_limit], dtype=np.float64) * world
    for index in order:
        remaining -= problem.work[index]
        reserved -= problem.least_memory[index]
        free = limits - state.load[[C.DEVICE_MEMORY, C.HOST_MEMORY]].sum(axis=1)

        def allowed(c: _Candidate, room: np.ndarray = free - reserved) -> bool:
            t = c.mode.terms
            return t.device_memory_bytes * c.mode.shards <= room[0] and (
                t.host_memory_bytes * c.mode.shards <= room[1]
            )

        def enough(c: _Candidate, rest: float = remaining) -> bool:
            return allowed(c) and c.step_s <= (c.work_s + rest) / world + _TIE

        candidates = _evaluate(state, index, enough, kinds)
        choice = _pick(candidates, remaining, world, prefer, allowed)
        if choice is None:
            raise _no_fit_error(state, index)
        state.add(index, choice.mode, choice.ranks)
    return state


def _no_fit_error(state: _State, index: int) -> DistcacheConfigError:
    problem, table = state.p, state.p.tables[index]
    reasons: dict[tuple, str] = {}
    for c in problem.rejects[index] + _evaluate(state, index):
        kind = (c.mode.sharding, c.mode.shards, c.mode.storage)
        if kind not in reasons or reasons[kind].startswith("a cache of"):
            reasons[kind] = c.reason  # a memory reason says more than a too-small cache
    listed = "; ".join(f"{_kind(*k)}: {r}" for k, r in reasons.items())
    return DistcacheConfigError(
        f"no placement of table {table.name!r} ({table.rows} rows x {table.dim}) fits "
        f"{problem.topology.name} ({_gb(problem.device_limit)} device, "
        f"{_gb(problem.host_limit)} host memory per rank): {listed or 'no allowed mode'}"
    )


class _MoveBudget:
    """Moves the local search may still try, and its wall-time safety limit."""

    def __init__(self, moves: int, time_limit_s: float):
        self.moves = moves
        self.deadline = time.monotonic() + time_limit_s
        self.timed_out = False

    def take(self, limit: int) -> bool:
        """Spend one move of a start allowed `limit` more; False once either is spent."""
        if limit <= 0 or self.moves <= 0:
            return False
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return False
        self.moves -= 1
        return True


def _improve(
    state: _State, budget: _MoveBudget, moves: int, singles: int = 16, pairs: int = 6
) -> None:
    """Local search until no move lowers (step, work) or `moves` tries are spent: re-place one
    of the `singles` tables loading the slowest rank most; failing that, re-place one of the
    `pairs` heaviest together with any other table (either first), which frees memory for a
    swap."""
    topology = state.p.topology
    weight = np.zeros(len(C.RANK_TERMS))  # rough seconds per unit of each rank term
    weight[[C.LOOKUP, C.OVERLAPPED, C.EXPOSED]] = 1.0
    weight[C.IDS_SI : C.EMB_RE + 1 : 2] = 1 / topology.intra_node_bw_bytes_per_s
    weight[C.IDS_SE : C.EMB_RE + 1 : 2] = 1 / topology.inter_node_bw_bytes_per_s
    left = budget.moves
    stop = left - moves  # the budget's level at which this start's share is spent

    def tried(m: tuple[int, ...]) -> bool:
        return budget.take(budget.moves - stop) and _try_move(state, m)

    while budget.moves > stop and not budget.timed_out:
        slowest = int(np.argmax(state.totals()))
        heavy = [
            i
            for _, i in sorted(
                ((float(weight @ c[:, slowest]), i) for i, c in enumerate(state.contrib)),
                reverse=True,
            )
        ]
        candidates = [(i,) for i in heavy[:singles]]
        candidates += [(i, j) for i in heavy[:pairs] for j in heavy[: 4 * pairs] if i != j]
        if not any(tried(m) for m in candidates):
            return


def _try_move(state: _State, tables: tuple[int, ...]) -> bool:
    """Re-place `tables` one after the other at their best; keep it if (step, work) drops."""
    current = state.score()
    old = [state.remove(i) for i in tables]
    placed = []
    for k, index in enumerate(tables):
        rest = sum(state.p.work[i] for i in tables[k + 1 :])
        floor = state.score()[0]
        last = k == len(tables) - 1  # the shortcut only holds with nothing left to place
        candidates = _evaluate(
            state, index, (lambda c, f=floor: c.step_s <= f + _TIE) if last else None
        )
        best = _pick(candidates, rest, state.p.world, "time")
        if best is None:
            break
        state.add(index, best.mode, best.ranks)
        placed.append(index)
    if len(placed) == len(tables) and _better(state.score(), current):
        return True
    for index in placed:
        state.remove(index)
    for index, removed in zip(tables, old, strict=True):
        state.add(index, *removed)
    return False


def _better(new: tuple[float, float], old: tuple[float, float], rtol: float = 1e-7) -> bool:
    """Lower step, or the same step and lower work (by more than a rounding error)."""
    if new[0] < old[0] * (1 - rtol):
        return True
    return new[0] <= old[0] * (1 + rtol) and new[1] < old[1] * (1 - rtol)


def _load_plan(problem: _Problem, plan: Plan) -> _State | None:
    """A state holding `plan` (a seed); None when it does not fit."""
    state = _State(problem)
    for index, (table, tp) in enumerate(zip(problem.tables, plan.tables, strict=True)):
        cache = (tp.storage, tp.cache_fraction, tp.lookahead, tp.prefetch_depth)
        key = (tp.sharding, len(tp.ranks), *cache)
        mode = problem.known[index].get(key) or problem.mode(table, *key[:2], cache)
        state.add(index, mode, tp.ranks)
        if not mode.terms.fits_working_set or not state.fits():
            return None
    return state


def solve(workload: Workload, topology: Topology, *, options: SolverOptions | None = None) -> Plan:
    """The plan with the least modelled step time found (see the module docstring).

    Args:
        workload: tables, batch and dense model.
        topology: the hardware.
        options: what may be chosen and the search's move budget (defaults: `SolverOptions()`).

    Raises:
        DistcacheConfigError: when no placement of some table fits the memory limits.

    Example::

        plan = solve(workload, topology, options=SolverOptions(cache_fractions=(0.02, 0.1)))
        print(plan_cost(plan, workload, topology).samples_per_s)
    """
    options = options or SolverOptions()
    began = time.monotonic()
    problem = _Problem(workload, topology, options)
    log.debug("solve: menus of %d tables in %.2f s", len(problem.tables), time.monotonic() - began)
    states, error = [], None
    for prefer in _PASSES:
        try:
            states.append(_greedy(problem, prefer))
        except DistcacheConfigError as exc:
            error = error or exc
        cached = any(m.storage == HOST_CACHED for s in states for m, _ in s.placed)
        if states and not cached:
            break  # memory was not binding: the other passes would find the same plan
    states += _single_type_starts(problem, states)
    for sharding in (TABLE_WISE, ROW_WISE, COLUMN_WISE, DATA_PARALLEL):
        if sharding in options.shardings and DEVICE in options.storages:
            shards = max(options.column_wise_shards, default=None)
            baseline = uniform_plan(workload, topology, sharding, column_wise_shards=shards)
            seed = _load_plan(problem, baseline)
            states += [seed] if seed is not None else []
    if not states:
        raise error
    log.debug("solve: %d starts by %.2f s", len(states), time.monotonic() - began)
    unique = {tuple((m, r) for m, r, *_ in s.placed): s for s in states}  # drop duplicates
    states = sorted(unique.values(), key=lambda s: s.score())
    budget = _MoveBudget(options.max_moves, options.time_limit_s)
    for i, state in enumerate(states):  # the best start first, with twice the others' share
        if state.score()[0] > 1.25 * states[0].score()[0]:
            break  # too far behind to overtake the best
        share = budget.moves * (2 if i == 0 else 1) // (len(states) - i + (i == 0))
        _improve(state, budget, share, pairs=6 if i == 0 else 2)
    if budget.timed_out:
        log.warning(
            "solve: the local search hit its %.0f s safety limit; the plan now depends on this "
            "machine's speed (lower SolverOptions.max_moves for a deterministic plan)",
            options.time_limit_s,
        )
    best = min(states, key=lambda s: s.score())
    log.debug(
        "solve: improved by %.2f s (%d moves left), step %.4g s",
        time.monotonic() - began,
        budget.moves,
        best.score()[0],
    )
    explanations = _explain(best) if options.explain else {}
    log.debug("solve: explained by %.2f s", time.monotonic() - began)
    return best.plan(f"distcache-{workload.name}-{topology.name}", explanations)


# Greedy passes: by work, picking for time; then, when memory binds (caches were needed), ties
# broken toward less memory, memory first, and the smallest tables first.
_PASSES = ("time", "time_memory", "memory", "small_first")


def _single_type_starts(problem: _Problem, states: list[_State]) -> list[_State]:
    """Greedy starts with every table of one sharding type, when each type a plan uses costs
    at least 1 % of the best start's step (its latencies and overhead, `cost.global_terms`):
    moving one table at a time, the local search cannot drop a type that many tables use."""
    if not states:
        return []
    best = min(s.score()[0] for s in states)
    workload, topology = problem.workload, problem.topology
    per_type = C.global_terms(workload, topology, 0.0, {TABLE_WISE}).shared_s
    per_type -= C.global_terms(workload, topology, 0.0, ()).shared_s
    if per_type < 0.01 * best:
        return []
    starts = []
    for sharding in problem.options.shardings:
        for prefer in _PASSES:  # as `solve`'s passes
            try:
                starts.append(_greedy(problem, prefer, kinds=(sharding,)))
            except DistcacheConfigError:
                continue  # no fitting placement of this type for some table, this way
            if not any(m.storage == HOST_CACHED for m, _ in starts[-1].placed):
                break  # memory did not bind: the other passes would find the same plan
    return starts


def _explain(state: _State) -> dict[str, str]:
    """Per table: the chosen placement and the best of every other kind (sharding, shards,
    storage) with the step the plan would have, or why it does not fit."""
    p, out = state.p, {}
    for index, table in enumerate(p.tables):
        mode, ranks, contrib = state.remove(index)
        without = state.score()[1]
        candidates = _evaluate(state, index) + p.rejects[index]
        state.add(index, mode, ranks, contrib)
        step, total = state.score()
        best: dict[tuple, _Candidate] = {}
        for c in candidates:
            kind = (c.mode.sharding, c.mode.shards, c.mode.storage)
            if (c.mode, c.ranks) != (mode, ranks) and (
                kind not in best or _rank(c) < _rank(best[kind])
            ):
                best[kind] = c
        rejected = [
            f"{c.mode.describe(c.ranks)} ({_cost_text(c.step_s, c.work_s - without)})"
            if c.fits
            else f"{c.mode.describe()} (does not fit: {c.reason})"
            for kind, c in sorted(best.items(), key=lambda kc: _rank(kc[1]))
        ]
        chosen = f"{mode.describe(ranks)}: {_cost_text(step, total - without)}"
        out[table.name] = chosen + ("; rejected: " + ", ".join(rejected) if rejected else "")
    return out


def _cost_text(step_s: float, added_s: float) -> str:
    return f"{step_s * 1e3:.3f} ms/step, adds {added_s * 1e3:.3g} ms of rank time"


def _rank(c: _Candidate) -> tuple:
    """Order within a kind: fitting by cost, then a memory reason before a too-small cache."""
    return (not c.fits, c.step_s, c.work_s, c.reason.startswith("a cache of"))


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def uniform_plan(
    workload: Workload,
    topology: Topology,
    sharding: str,
    *,
    storage: str = DEVICE,
    cache_fraction: float = 1.0,
    lookahead: int = 0,
    prefetch_depth: int = 0,
    name: str | None = None,
    column_wise_shards: int | None = None,
) -> Plan:
    """Every table placed the same way: a baseline for the solver.

    Table-wise: largest tables first, each on the rank with the fewest bytes so far. Row-wise
    and data parallel: all ranks. Column-wise: S = the largest divisor of the dim that is at
    most the world size (and `column_wise_shards`), on the S ranks with the fewest bytes.

    Args:
        workload: the tables.
        topology: the ranks.
        sharding: one of `types.SHARDING_TYPES`.
        storage, cache_fraction, lookahead, prefetch_depth: as in `TablePlan`, for every table.
        name: the plan's name (default "all-<sharding>[-<storage>]").
        column_wise_shards: at most this many shards per column-wise table.

    Example::

        baseline = uniform_plan(workload, topology, TABLE_WISE)
    """
    if sharding not in SHARDING_TYPES:
        raise DistcacheConfigError(f"sharding {sharding!r} is not one of {SHARDING_TYPES}")
    world = topology.world_size
    everyone = tuple(range(world))
    assigned = [(0.0, rank) for rank in everyone]  # a heap of (bytes so far, rank)
    tables = sorted(workload.tables, key=lambda t: -t.rows * workload.row_bytes(t))
    plans = {}
    for table in tables:
        size = table.rows * workload.row_bytes(table) * (1 if storage == DEVICE else cache_fraction)
        if sharding in (DATA_PARALLEL, ROW_WISE):
            ranks = everyone
        else:
            shards = 1
            if sharding == COLUMN_WISE:
                most = min(world, table.dim, column_wise_shards or world)
                shards = max(s for s in range(1, most + 1) if table.dim % s == 0)
            least = [heapq.heappop(assigned) for _ in range(shards)]
            for used, rank in least:
                heapq.heappush(assigned, (used + size / shards, rank))
            ranks = tuple(sorted(rank for _, rank in least))
        plans[table.name] = TablePlan(
            table=table.name,
            sharding=sharding,
            ranks=ranks,
            storage=storage,
            cache_fraction=cache_fraction,
            lookahead=lookahead,
            prefetch_depth=prefetch_depth,
        )
    suffix = "" if storage == DEVICE else f"-{storage}"
    return Plan(
        name=name or f"all-{sharding}{suffix}",
        tables=tuple(plans[t.name] for t in workload.tables),
    )
