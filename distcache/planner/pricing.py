"""The solver's pricing: a partial plan's per-rank terms (`State`), and every mode of one
table priced against it at its best ranks (`evaluate`), on every rank at once.

Each candidate's step per rank comes from `ranks.rank_step`, the formula `plan_cost` uses, on
the state's terms plus the candidate's; each part is computed at the shape it varies with
([M, W] for M modes, [N, W] when only the owner's node matters). So a candidate's step is the
step `plan_cost` gives the plan once the table is placed (tests/unit/planner/test_pricing.py).

Example::

    state = State(problem)
    for index in range(len(problem.tables)):
        best = min((c for c in evaluate(state, index) if c.fits), key=lambda c: c.step_s)
        state.add(index, best.mode, best.ranks)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection

import numpy as np

from distcache.cache.config import HOT_TOUCHED
from distcache.planner.candidates import TIE_S, Candidate, Group, Mode, Problem, gb
from distcache.planner.cost import global_terms
from distcache.planner.ranks import (
    Peers,
    RankStep,
    RankTerms,
    Traffic,
    exchange,
    peer_counts,
    rank_step,
    rank_step_of,
    reduced_in_node,
    shard_contribution,
)
from distcache.planner.shards import ShardTerms, sent_bags_per_rank
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Plan,
    Topology,
)


class State:
    """Accumulated rank terms (`ranks.RankTerms`) of the tables placed so far.

    A state is judged by (step, work): the slowest rank's step, exactly as `plan_cost` prices
    it, and the rank time summed over ranks with all-to-all bytes counted linearly (half at the
    sender, half at the receiver). Taking the busier direction per rank, as the step does,
    would make a lone table-wise shard look twice as costly as it is once ranks both send and
    receive, and steer the greedy away from table-wise early on.
    """

    def __init__(self, problem: Problem):
        self.p = problem
        self.load = RankTerms.zeros(problem.world)
        self.dp_bytes = 0.0
        self.kinds: Counter[str] = Counter()  # tables placed per `ShardTerms.collectives`
        self.sent_bags = 0.0  # bags each rank sends per step
        self.hot_bytes = 0.0  # hot-row replicas' gradients and flags all-reduced per step
        self.hot_tables = 0
        self.gather_bytes = 0.0  # replicas' touched rows each rank all-gathers per step
        self.gathered_tables = 0
        self.link_work_s = 0.0
        self.placed: list[tuple[Mode, tuple[int, ...]] | None] = [None] * len(problem.tables)
        self.contrib: list[RankTerms | None] = [None] * len(problem.tables)

    def constant_s(self, mode: Mode | None = None) -> float:
        """What every rank pays alike (all-reduce, all-to-all latencies, per-sharding-type
        overheads) if `mode` were added."""
        dp = self.dp_bytes + (mode.terms.all_reduce_bytes if mode else 0.0)
        sent = self.sent_bags + (sent_bags_per_rank(mode.terms, mode.shards) if mode else 0.0)
        kinds = {k for k, n in self.kinds.items() if n > 0}
        kinds |= {mode.terms.collectives} if mode is not None else set()
        hot_bytes = self.hot_bytes + (mode.terms.hot_reduce_bytes if mode else 0.0)
        hot_tables = self.hot_tables + (mode is not None and mode.hot_rows > 0)
        gather = self.gather_bytes + (mode.terms.hot_gather_bytes if mode else 0.0)
        gathered = self.gathered_tables + (mode is not None and _gathers(mode))
        return global_terms(
            self.p.workload,
            self.p.topology,
            dp,
            kinds,
            sent,
            hot_bytes,
            hot_tables,
            gather,
            gathered,
        ).shared_s

    def step(self) -> RankStep:
        """[W] parts of the step per rank, without the shared terms (`constant_s`)."""
        return rank_step_of(self.load, dense_s=self.p.dense_s, topology=self.p.topology)

    def totals(self) -> np.ndarray:
        """[W] step per rank, as `plan_cost` prices it."""
        return self.step().total_s(self.constant_s())

    def add(
        self, index: int, mode: Mode, ranks: tuple[int, ...], contrib: RankTerms | None = None
    ) -> None:
        """Place table `index` (`contrib`: its rank terms, if known from an earlier `remove`)."""
        if contrib is None:
            contrib = shard_contribution(mode.terms, ranks, self.p.topology)
        self.load += contrib
        self.dp_bytes += mode.terms.all_reduce_bytes
        self.kinds[mode.terms.collectives] += 1
        self.sent_bags += sent_bags_per_rank(mode.terms, mode.shards)
        self.hot_bytes += mode.terms.hot_reduce_bytes
        self.hot_tables += mode.hot_rows > 0
        self.gather_bytes += mode.terms.hot_gather_bytes
        self.gathered_tables += _gathers(mode)
        self.link_work_s += self._link_work(mode, ranks, contrib)
        self.placed[index], self.contrib[index] = (mode, ranks), contrib

    def remove(self, index: int) -> tuple[Mode, tuple[int, ...], RankTerms]:
        """Take table `index` out; returns what `add` needs to put it back."""
        (mode, ranks), contrib = self.placed[index], self.contrib[index]
        self.load -= contrib
        self.dp_bytes -= mode.terms.all_reduce_bytes
        self.kinds[mode.terms.collectives] -= 1
        self.sent_bags -= sent_bags_per_rank(mode.terms, mode.shards)
        self.hot_bytes -= mode.terms.hot_reduce_bytes
        self.hot_tables -= mode.hot_rows > 0
        self.gather_bytes -= mode.terms.hot_gather_bytes
        self.gathered_tables -= _gathers(mode)
        self.link_work_s -= self._link_work(mode, ranks, contrib)
        self.placed[index] = self.contrib[index] = None
        return mode, ranks, contrib

    def _link_work(self, mode: Mode, ranks: tuple[int, ...], contrib: RankTerms) -> float:
        if mode.terms.reduced_in_node:
            return traffic_work(contrib.ids, contrib.emb, self.p.topology)
        return _link_work(mode.terms, self.p.pair_s[list(ranks)].sum())

    def score(self) -> tuple[float, float]:
        """(step, work): see the class docstring."""
        step, shared = self.step(), self.constant_s()
        work = step.core_s.sum() + self.link_work_s + self.p.world * shared
        return float(step.total_s(shared).max()), float(work)

    def fits(self) -> bool:
        return bool(
            (self.load.device_memory_bytes <= self.p.device_limit).all()
            and (self.load.host_memory_bytes <= self.p.host_limit).all()
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


def traffic_work(ids: Traffic, emb: Traffic, topology: Topology) -> float:
    """All-to-all seconds summed over ranks, bytes counted linearly (half at the sender, half
    at the receiver), embeddings forward and backward: `_link_work` for any traffic."""

    def seconds(t: Traffic) -> float:
        intra = (np.sum(t.sent_intra) + np.sum(t.received_intra)) / 2
        inter = (np.sum(t.sent_inter) + np.sum(t.received_inter)) / 2
        return float(
            intra / topology.intra_node_bw_bytes_per_s + inter / topology.inter_node_bw_bytes_per_s
        )

    return seconds(ids) + 2 * seconds(emb)


def evaluate(
    state: State,
    index: int,
    enough: Callable[[Candidate], bool] | None = None,
    kinds: Collection[str] | None = None,
) -> list[Candidate]:
    """Every mode of table `index` at its best ranks (only sharding types in `kinds`, if
    given). With `enough`, stop after data parallel and table-wise when a table-wise
    candidate satisfies it: row- and column-wise move more bytes than table-wise for the same
    lookups, so they only help a table that would be the bottleneck."""
    out: list[Candidate] = []
    for group in state.p.groups[index]:  # data parallel, table-wise, then the others
        if kinds is not None and group.sharding not in kinds:
            continue
        if group.sharding in (ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE) and enough is not None:
            if any(c.fits and c.mode.sharding == TABLE_WISE and enough(c) for c in out):
                break
            enough = None  # decided: the spread layouts are priced
        if group.sharding == TABLE_WISE:
            out += _evaluate_table_wise(state, group)
        elif group.sharding == COLUMN_WISE:
            out += _evaluate_column_wise(state, group)
        elif group.sharding == TABLE_ROW_WISE:
            out += _evaluate_node(state, group)
        else:
            out += _evaluate_everywhere(state, group)
    return out


def _step(
    state: State,
    ids: Traffic,
    emb: Traffic,
    group: Group | None = None,
    owner: np.ndarray | float = 1.0,
) -> RankStep:
    """The state's step parts per rank with extra all-to-all bytes `ids` and `emb` and, with
    `group`, one shard of each of its modes where `owner` ([M, W] or 1.0: every rank) is 1."""
    load = state.load
    lookup, overlapped, exposed = load.lookup_s, load.overlapped_staging_s, load.exposed_staging_s
    if group is not None:
        lookup = lookup + group.lookup * owner
        overlapped = overlapped + group.overlapped * owner
        exposed = exposed + group.exposed * owner
    return rank_step(
        dense_s=state.p.dense_s,
        lookup_s=lookup,
        overlapped_staging_s=overlapped,
        exposed_staging_s=exposed,
        ids=load.ids.plus(ids),
        emb=load.emb.plus(emb),
        topology=state.p.topology,
    )


def _memory_ok(state: State, group: Group) -> np.ndarray:
    """[M, W]: whether one more shard of each mode fits each rank."""
    load, p = state.load, state.p
    return (load.device_memory_bytes + group.device <= p.device_limit) & (
        load.host_memory_bytes + group.host <= p.host_limit
    )


def _owner_step(state: State, group: Group) -> tuple[np.ndarray, np.ndarray]:
    """([M, W] core, [M, W] step) of each rank if it alone held one shard of each mode."""
    p = state.p
    alone = Peers(0.0, 0.0, p.node_size - 1.0, p.world - p.node_size)  # every rank consumes
    step = _step(state, *exchange(group.ids, group.emb, alone), group)
    return step.core_s, step.total_s(state.constant_s(group.modes[0]))


def _spread(state: State, group: Group, is_owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([M, W] step per rank, [M] work) with the group's shards where `is_owner` [M, W] is 1."""
    peers = peer_counts(is_owner, state.p.topology)
    step = _step(state, *exchange(group.ids, group.emb, peers), group, is_owner)
    const = state.constant_s(group.modes[0])
    pair_s = is_owner @ state.p.pair_s  # [M]
    work = (
        step.core_s.sum(axis=-1)
        + state.link_work_s
        + (group.ids + 2 * group.emb) * pair_s
        + state.p.world * const
    )
    return step.total_s(const), work


def _evaluate_table_wise(state: State, group: Group) -> list[Candidate]:
    """Each mode on every rank at once: the owner's step from `_owner_step`, every other
    rank's from the consumer terms, which depend only on the owner's node."""
    p, W = state.p, state.p.world
    i, e = group.ids, group.emb
    owner_on_node = Peers(p.same_node, 1 - p.same_node, 0.0, 0.0)  # [N, W] by the owner's node
    consumers = _step(state, *exchange(i, e, owner_on_node))
    core0, const = consumers.core_s, state.constant_s(group.modes[0])  # [W]
    others = consumers.total_s(const)  # [N, W] step of each rank when the owner is on node n
    core, owner = _owner_step(state, group)  # [M, W]
    ok = _memory_ok(state, group)
    ranks = np.arange(W)
    order = np.argsort(others, axis=1)
    first = others[np.arange(p.nodes), order[:, -1]]
    second = others[np.arange(p.nodes), order[:, -2]] if W > 1 else np.full(p.nodes, -np.inf)
    rest_max = np.where(order[p.node, -1] == ranks, second[p.node], first[p.node])  # [W]
    step = np.where(ok, np.maximum(owner, rest_max), np.inf)
    work = core0.sum() - core0 + core + state.link_work_s + (i + 2 * e) * p.pair_s + W * const
    best = np.lexsort((owner, np.round(work / TIE_S), np.round(step / TIE_S)), axis=-1)[:, 0]
    return [
        Candidate(mode, (int(r),), float(step[m, r]), float(work[m, r]))
        if ok[m, r]
        else _no_room(state, mode)
        for m, (mode, r) in enumerate(zip(group.modes, best, strict=True))
    ]


def _evaluate_everywhere(state: State, group: Group) -> list[Candidate]:
    """Data parallel and row-wise: a shard on every rank."""
    p = state.p
    totals, work = _spread(state, group, np.ones((1, p.world)))  # [M, W], [M]
    ok = _memory_ok(state, group).all(axis=-1)
    everyone = tuple(range(p.world))
    return [
        Candidate(mode, everyone, float(totals[m].max()), float(work[m]))
        if ok[m]
        else _no_room(state, mode)
        for m, mode in enumerate(group.modes)
    ]


def _evaluate_node(state: State, group: Group) -> list[Candidate]:
    """Table-row-wise: the shards on every rank of one node, each node tried; the node whose
    step (then work) is least wins. Output traffic as TorchRec runs it (`reduced_in_node`)."""
    p = state.p
    ok = _memory_ok(state, group)  # [M, W]
    const = state.constant_s(group.modes[0])
    best_step = np.full(len(group.modes), np.inf)
    best_work = np.full(len(group.modes), np.inf)
    best_node = np.zeros(len(group.modes), dtype=int)
    for n in range(p.nodes):
        is_owner = p.same_node[n]  # [W]
        ids, _ = exchange(group.ids, group.emb, peer_counts(is_owner, p.topology))
        emb = reduced_in_node(group.emb, is_owner, p.topology)
        step = _step(state, ids, emb, group, is_owner)
        totals = step.total_s(const).max(axis=-1)  # [M]
        work = (
            step.core_s.sum(axis=-1)
            + state.link_work_s
            + traffic_work(ids, emb, p.topology)
            + p.world * const
        )
        fits = ok[:, is_owner > 0].all(axis=-1)
        totals = np.where(fits, totals, np.inf)
        tie = np.isfinite(totals) & (totals <= best_step + TIE_S)
        wins = (totals < best_step - TIE_S) | (tie & (work < best_work - TIE_S))
        best_step = np.where(wins, totals, best_step)
        best_work = np.where(wins, work, best_work)
        best_node = np.where(wins, n, best_node)
    ranks_of = [tuple(int(r) for r in np.flatnonzero(p.same_node[n])) for n in range(p.nodes)]
    return [
        Candidate(mode, ranks_of[best_node[m]], float(best_step[m]), float(best_work[m]))
        if np.isfinite(best_step[m])
        else _no_room(state, mode)
        for m, mode in enumerate(group.modes)
    ]


def _evaluate_column_wise(state: State, group: Group) -> list[Candidate]:
    """Shards go to the S ranks where one shard alone would cost least; then priced exactly."""
    p, shards = state.p, group.shards
    _, owner = _owner_step(state, group)
    ok = _memory_ok(state, group)  # [M, W]
    chosen = np.lexsort((owner, ~ok), axis=-1)[:, :shards]  # [M, S] cheapest fitting ranks
    is_owner = np.zeros((len(group.modes), p.world))
    np.put_along_axis(is_owner, chosen, 1.0, axis=-1)
    totals, work = _spread(state, group, is_owner)
    return [
        Candidate(
            mode,
            tuple(sorted(int(r) for r in chosen[m])),
            float(totals[m].max()),
            float(work[m]),
        )
        if ok[m].sum() >= shards
        else _no_room(state, mode)
        for m, mode in enumerate(group.modes)
    ]


def _no_room(state: State, mode: Mode) -> Candidate:
    """A candidate that does not fit, saying which memory is short on its ranks."""
    t, p = mode.terms, state.p
    needed = p.world if mode.sharding in (DATA_PARALLEL, ROW_WISE) else mode.shards
    reason = f"no {needed} rank(s) with room for a shard"
    for kind, used, need, limit in (
        ("device", state.load.device_memory_bytes, t.device_memory_bytes, p.device_limit),
        ("host", state.load.host_memory_bytes, t.host_memory_bytes, p.host_limit),
    ):
        free = np.sort(limit - used)[-needed]  # the needed-th most free rank's
        if need > free:
            reason = f"needs {gb(need)} {kind} memory per shard, {gb(max(free, 0))} free"
            break
    return Candidate(mode, (), math.inf, math.inf, reason=reason)


def _gathers(mode: Mode) -> bool:
    """Whether `mode` replicates hot rows whose touched rows are all-gathered."""
    return mode.hot_rows > 0 and mode.hot_reduce == HOT_TOUCHED
