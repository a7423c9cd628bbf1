"""The solver's partial plan: the per-rank terms of the tables placed so far (`State`), what
placing one table adds to them (`Footprint`), and the plan's (step, work) score.

A state keeps its rank terms ([TERMS, W], `ranks.RankTerms`) and a few scalars (all-reduce
bytes, bags sent, replicas' collectives, link work) in one flat array, and each placed table
its footprint of the same shape, so that placing or removing a table is one array addition.
Placing and removing again need not restore the array bit for bit (x - a + a is not always
x); the solver's choices depend on those bits only through near-ties, but every stage
updates the array in the same order as `add` and `remove` would, so that the plans are the
same however the stages price (`trial_scores`, `explain.py`).

Example::

    state = State(problem)
    state.add(0, mode, ranks=(3,))
    step_s, work_s = state.score()
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from distcache.constants import HOT_TOUCHED
from distcache.planner.candidates import Mode, Problem
from distcache.planner.ranks import (
    RANK_TERMS,
    TRAFFIC,
    RankStep,
    RankTerms,
    rank_step_of,
    shard_contributions,
)
from distcache.planner.shards import ShardTerms, sent_bags_per_rank
from distcache.planner.types import Plan, Topology

# What a placed table adds to a state beside its rank terms, kept after them in one array (a
# footprint) so that placing or removing a table is one array operation.
_SCALARS = (
    "dp_bytes",  # data-parallel gradients all-reduced per step
    "sent_bags",  # bags each rank sends per step
    "hot_bytes",  # hot-row replicas' gradients and flags all-reduced per step
    "hot_tables",
    "gather_bytes",  # replicas' touched rows each rank all-gathers per step
    "gathered_tables",
    "link_work_s",  # all-to-all seconds summed over ranks (`traffic_work`)
)
LINK_WORK = _SCALARS.index("link_work_s")


class Footprint(NamedTuple):
    """What placing a table adds to a `State`."""

    flat: np.ndarray
    """[TERMS·W + scalars]: the rank terms, then `_SCALARS`."""
    values: np.ndarray
    """[TERMS, W]: the rank terms (`RankTerms.values`; a view of `flat`)."""
    collectives: str
    """`ShardTerms.collectives` of its mode."""


def _scalar(name: str) -> property:
    offset = _SCALARS.index(name)
    return property(lambda self: float(self.flat[self.size + offset]), doc=f"{name}.")


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
        self.size = len(RANK_TERMS) * problem.world
        self.flat = np.zeros(self.size + len(_SCALARS))  # the rank terms, then `_SCALARS`
        self.load = RankTerms(self.flat[: self.size].reshape(len(RANK_TERMS), problem.world))
        self.kinds: Counter[str] = Counter()  # tables placed per `ShardTerms.collectives`
        self.placed: list[tuple[Mode, tuple[int, ...]] | None] = [None] * len(problem.tables)
        self.contrib: list[Footprint | None] = [None] * len(problem.tables)

    dp_bytes = _scalar("dp_bytes")
    sent_bags = _scalar("sent_bags")
    hot_bytes = _scalar("hot_bytes")
    gather_bytes = _scalar("gather_bytes")
    link_work_s = _scalar("link_work_s")

    def constant_s(self, mode: Mode | None = None) -> float:
        """What every rank pays alike (all-reduce, all-to-all latencies, per-sharding-type
        overheads) if `mode` were added."""
        return shared_s(self.p, self.flat[self.size :], self.kinds, mode)

    def step(self) -> RankStep:
        """[W] parts of the step per rank, without the shared terms (`constant_s`)."""
        return rank_step_of(self.load, dense_s=self.p.dense_s, topology=self.p.topology)

    def totals(self) -> np.ndarray:
        """[W] step per rank, as `plan_cost` prices it."""
        return self.step().total_s(self.constant_s())

    def footprints(self, modes: Sequence[Mode], ranks: tuple[int, ...]) -> list[Footprint]:
        """What placing a table on `ranks` as each of `modes` would add (modes of one layout, or
        of tables on the same ranks all reduced in their node or none: `shard_contributions`)."""
        p, terms = self.p, [m.terms for m in modes]
        flat = np.empty((len(modes), self.flat.size))
        values = flat[:, : self.size].reshape(len(modes), len(RANK_TERMS), p.world)
        values[:] = shard_contributions(terms, ranks, p.topology)
        flat[:, self.size :] = [
            (*_mode_scalars(mode), self._link_work(mode, ranks, rank_terms))
            for rank_terms, mode in zip(values, modes, strict=True)
        ]
        return [
            Footprint(row, rank_terms, t.collectives)
            for row, rank_terms, t in zip(flat, values, terms, strict=True)
        ]

    def add(
        self, index: int, mode: Mode, ranks: tuple[int, ...], contrib: Footprint | None = None
    ) -> None:
        """Place table `index` (`contrib`: its footprint, if known from an earlier `remove`)."""
        if contrib is None:
            (contrib,) = self.footprints((mode,), ranks)
        self.flat += contrib.flat
        self.kinds[contrib.collectives] += 1
        self.placed[index], self.contrib[index] = (mode, ranks), contrib

    def remove(self, index: int) -> tuple[Mode, tuple[int, ...], Footprint]:
        """Take table `index` out; returns what `add` needs to put it back."""
        (mode, ranks), contrib = self.placed[index], self.contrib[index]
        self.flat -= contrib.flat
        self.kinds[contrib.collectives] -= 1
        self.placed[index] = self.contrib[index] = None
        return mode, ranks, contrib

    def _link_work(self, mode: Mode, ranks: tuple[int, ...], values: np.ndarray) -> float:
        """`traffic_work` of a table placed as `mode` on `ranks`, whose rank terms are
        `values` [TERMS, W]."""
        if mode.terms.reduced_in_node:
            return float(traffic_work(values[TRAFFIC], self.p.topology))
        return _link_work(mode.terms, self.p.pair_sum(ranks))

    def score(self) -> tuple[float, float]:
        """(step, work): see the class docstring."""
        step, shared = self.step(), self.constant_s()
        work = step.core_s.sum() + self.link_work_s + self.p.world * shared
        return float(step.total_s(shared).max()), float(work)

    def scores(
        self, flats: np.ndarray, kinds: Sequence[Counter[str]]
    ) -> list[tuple[float, float, bool]]:
        """(step, work, fits) of K states of this problem whose flat arrays are `flats`
        [K, TERMS·W + scalars] and collectives `kinds`: `score` and `fits`, priced together."""
        p, start = self.p, self.size
        terms = flats[:, :start].reshape(len(flats), len(RANK_TERMS), p.world)
        load = RankTerms(terms.swapaxes(0, 1))  # rows of [K, W]
        shared = _shared_of_rows(p, flats[:, start:], kinds)
        step = rank_step_of(load, dense_s=p.dense_s, topology=p.topology)  # [K, W]
        totals = step.total_s(shared[:, None]).max(axis=-1)
        work = step.core_s.sum(axis=-1) + flats[:, start + LINK_WORK] + p.world * shared
        fits = (load.device_memory_bytes <= p.device_limit).all(axis=-1) & (
            load.host_memory_bytes <= p.host_limit
        ).all(axis=-1)
        return list(zip(totals.tolist(), work.tolist(), fits.tolist(), strict=True))

    def trial_scores(
        self, trials: Sequence[tuple[int, Sequence[Footprint]]]
    ) -> tuple[tuple[float, float] | None, list[list[tuple[float, float] | None]]]:
        """The `score` of the state as it is, and for each (index, footprints) of `trials`
        the score with table `index` in each of its footprints instead (None where it does not
        fit), all priced together; the state is left as it is. (Each row is priced as alone:
        a batch of trials scores them as one at a time would.)"""
        # Row 0 the state; then per trial, the state without the table plus each footprint.
        rows, kinds, without, counts = [self.flat], [self.kinds], [], []
        for index, footprints in trials:
            now = self.contrib[index]
            rows += [footprint.flat for footprint in footprints]
            without.append(self.flat - now.flat)
            counts.append(len(footprints))
            kinds += [_swapped(self.kinds, now.collectives, f.collectives) for f in footprints]
        flats = np.stack(rows)
        if len(rows) > 1:
            flats[1:] += np.repeat(np.stack(without), counts, axis=0)
        scored = [(step, work) if fits else None for step, work, fits in self.scores(flats, kinds)]
        out, at = [], 1
        for _, footprints in trials:
            out.append(scored[at : at + len(footprints)])
            at += len(footprints)
        return scored[0], out

    def fits(self) -> bool:
        return bool(
            (self.load.device_memory_bytes <= self.p.device_limit).all()
            and (self.load.host_memory_bytes <= self.p.host_limit).all()
        )

    def plan(self, name: str, explanations: dict[str, str]) -> Plan:
        tables = tuple(
            mode.placement.table_plan(t.name, ranks)
            for t, (mode, ranks) in zip(self.p.tables, self.placed, strict=True)
        )
        return Plan(name=name, tables=tables, explanations=explanations)


def shared_s(
    problem: Problem, scalars: np.ndarray, kinds: Counter[str], mode: Mode | None = None
) -> float:
    """`State.constant_s` of a state of `problem` whose `_SCALARS` are `scalars` and whose
    tables use the collectives `kinds` (counts), with `mode` added if given."""
    return shared_with_modes(problem, scalars, kinds, [mode])[0]


def shared_with_modes(
    problem: Problem, scalars: np.ndarray, kinds: Counter[str], modes: Sequence[Mode | None]
) -> list[float]:
    """`shared_s(problem, scalars, kinds, mode)` of each of `modes`."""
    base = scalars.tolist()[:LINK_WORK]  # (link work, the last, is not shared)
    used = _in_use(kinds)
    out = []
    for mode in modes:
        values, with_mode = base, used
        if mode is not None:
            values = [x + a for x, a in zip(base, _mode_scalars(mode), strict=True)]
            with_mode = used | {mode.terms.collectives}
        out.append(_shared(problem, with_mode, *values))
    return out


def shared_with_layouts(
    problem: Problem,
    scalars: np.ndarray,
    kinds: Sequence[Counter[str]],
    modes: Sequence[Sequence[Mode]],
) -> np.ndarray:
    """[K, L] `shared_with_modes(problem, scalars[k], kinds[k], modes[k])` of K states (rows
    of `scalars` [K, scalars]) and L modes each, priced together: equal to the bit. (One
    state's modes cost less one by one: here, six took 20-45 us so and 110 us together;
    sixteen states' six, 165 against 360 us.)"""
    if len(modes) == 1:
        return np.array([shared_with_modes(problem, scalars[0], kinds[0], modes[0])])
    used = [_in_use(kind) for kind in kinds]
    added = np.array([[_mode_scalars(m) for m in row] for row in modes], dtype=np.float64)
    args = scalars[:, None, :LINK_WORK] + added  # [K, L, 6] (x + a, as the scalar sum)
    with_modes = [
        u | {m.terms.collectives} for u, row in zip(used, modes, strict=True) for m in row
    ]
    shared = problem.shared.shared_rows_s(with_modes, args.reshape(-1, LINK_WORK))
    return shared.reshape(args.shape[:2])


def _shared_of_rows(
    problem: Problem, scalars: np.ndarray, kinds: Sequence[Counter[str]]
) -> np.ndarray:
    """[K] `shared_s` of each row of `scalars` [K, scalars] with `kinds[k]`, priced together
    (the same counts are often passed for many rows: their set of collectives is made once)."""
    used: dict[int, frozenset[str]] = {}
    for k in kinds:
        if id(k) not in used:
            used[id(k)] = _in_use(k)
    return problem.shared.shared_rows_s([used[id(k)] for k in kinds], scalars[:, :LINK_WORK])


def _in_use(kinds: Counter[str]) -> frozenset[str]:
    """The collectives some placed table uses, of counts `kinds` (`State.kinds`)."""
    return frozenset(name for name, n in kinds.items() if n > 0)


def _shared(
    problem: Problem,
    used: frozenset[str],
    dp: float,
    sent: float,
    hot_bytes: float,
    hot_tables: float,
    gather: float,
    gathered: float,
) -> float:
    """`SharedTerms.shared_s` of a state whose `_SCALARS` (link work aside) are the rest and
    whose tables use the collectives `used`."""
    return problem.shared.shared_s(
        dp, used, sent, hot_bytes, int(hot_tables), gather, int(gathered)
    )


def _mode_scalars(mode: Mode) -> tuple[float, float, float, bool, float, bool]:
    """What placing a table as `mode` adds to a state's `_SCALARS`, link work aside."""
    t = mode.terms
    return (
        t.all_reduce_bytes,
        sent_bags_per_rank(t, mode.placement.shards),
        t.hot_reduce_bytes,
        t.hot_rows > 0,
        t.hot_gather_bytes,
        _gathers(t),
    )


def _link_work(terms: ShardTerms, pair_s: float) -> float:
    """All-to-all seconds of a table summed over ranks, bytes counted linearly: `pair_s` is
    the sum over its shards of the seconds per byte exchanged with every other rank."""
    return (terms.ids_bytes_per_peer + 2 * terms.embedding_bytes_per_peer) * pair_s


def traffic_work(traffic: np.ndarray, topology: Topology) -> np.ndarray:
    """All-to-all seconds summed over ranks (the last axis) of `traffic` [8, ..., W] (as
    `RankTerms.traffic`), bytes counted linearly (half at the sender, half at the receiver),
    embeddings forward and backward: `_link_work` for any traffic. [...] seconds."""
    sums = traffic.sum(axis=-1).reshape(2, 2, 2, *traffic.shape[1:-1])  # [collective, dir, link]
    intra = (sums[:, 0, 0] + sums[:, 1, 0]) / 2  # sent and received over NVLink
    inter = (sums[:, 0, 1] + sums[:, 1, 1]) / 2
    ids, emb = (
        intra / topology.intra_node_bw_bytes_per_s + inter / topology.inter_node_bw_bytes_per_s
    )
    return ids + 2 * emb


def _swapped(kinds: Counter[str], out: str, into: str) -> Counter[str]:
    """`kinds` with one table of collectives `out` moved to `into`."""
    if out == into:
        return kinds
    return kinds - Counter({out: 1}) + Counter({into: 1})


def _gathers(terms: ShardTerms) -> bool:
    """Whether a table of `terms` replicates hot rows whose touched rows are all-gathered."""
    return terms.hot_rows > 0 and terms.hot_reduce == HOT_TOUCHED
