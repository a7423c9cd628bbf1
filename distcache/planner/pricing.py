"""The solver's pricing: every mode of a table priced against a partial plan (`State`) at its
best ranks (`evaluate`), on every rank at once; and the same for many tables, each against a
plan of its own (`price_tables`: `explain.py` prices every table against the plan without it).

Each candidate's step per rank comes from `ranks.rank_step`, the formula `plan_cost` uses, on
the plan's terms plus the candidate's. A table's layouts need a few partial steps each
(`_NEEDS`) — a shard of each mode on every rank (data parallel, row-wise); each rank as the lone
owner, and the others with the owner on their node or not (table-wise); each rank as an owner
and as a consumer (table-row-wise); each rank as the lone owner, then the S ranks chosen
(column-wise) — and all of them are priced as the rows of one step ([K, R, W] for K tables of
one layout signature, `_Batch`), each row on its traffic, which the rows of a layout share
([K, T, W]). The layouts then read their rows (`_everywhere`, `_table_wise`, ...). So a
candidate's step is the step `plan_cost` gives the plan once the table is placed
(tests/unit/planner/test_pricing.py).

Example::

    state = State(problem)
    for index in range(len(problem.tables)):
        best = min((c for c in evaluate(state, index) if c.fits), key=lambda c: c.step_s)
        state.add(index, best.mode, best.ranks)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence

import numpy as np

from distcache.planner.candidates import (
    ALONE,
    EVERYONE,
    FAR,
    NEAR,
    NODE_CONSUMER,
    NODE_OWNER,
    SPREAD,
    TIE_S,
    Candidate,
    Group,
    Mode,
    Problem,
    gb,
)
from distcache.planner.ranks import RANK_TERMS, RankStep, RankTerms, rank_step, traffic_units
from distcache.planner.state import LINK_WORK, State, shared_with_layouts, traffic_work
from distcache.planner.types import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, TABLE_WISE

__all__ = ["State", "cut_as_enough", "evaluate", "price_tables", "traffic_work"]

# The partial steps each layout needs: (traffic template of `Problem.units`, whether with a
# shard of each mode on every rank); a layout's first step is the one with its modes.
_NEEDS = {
    DATA_PARALLEL: ((EVERYONE, True),),
    TABLE_WISE: ((ALONE, True), (NEAR, False), (FAR, False)),
    ROW_WISE: ((EVERYONE, True),),
    TABLE_ROW_WISE: ((NODE_OWNER, True), (NODE_CONSUMER, False)),
    COLUMN_WISE: ((ALONE, True),),
}


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
    table = _Table.of(state.p, index, _NEEDS if kinds is None else kinds)
    if not table.groups:
        return []
    batch = _Batch(state.p, [table], state.flat[None], [state.kinds])
    out: list[Candidate] = []
    for j, group in enumerate(table.groups):  # data parallel, table-wise, then the others
        if group.sharding in SPREAD and enough is not None:
            if _table_wise_enough(out, enough):
                break
            enough = None  # decided: the spread layouts are priced
        out += batch.layout(j)[0]
    return out


def cut_as_enough(
    candidates: list[Candidate], enough: Callable[[Candidate], bool]
) -> list[Candidate]:
    """A table's candidates (every layout, in `evaluate`'s order: `price_tables`) as
    `evaluate` with `enough` returns them: without the spread layouts when a table-wise
    candidate satisfies `enough`."""
    for at, c in enumerate(candidates):
        if c.mode.placement.sharding in SPREAD:
            return candidates[:at] if _table_wise_enough(candidates[:at], enough) else candidates
    return candidates


def _table_wise_enough(candidates: list[Candidate], enough: Callable[[Candidate], bool]) -> bool:
    return any(c.fits and c.mode.placement.sharding == TABLE_WISE and enough(c) for c in candidates)


def price_tables(
    problem: Problem, indices: Sequence[int], flats: np.ndarray, kinds: Sequence[Counter[str]]
) -> list[list[Candidate]]:
    """`evaluate` of each table `indices[k]` against the plan whose `State.flat` is
    `flats[k]` and collectives `kinds[k]`; tables of one layout signature priced together."""
    tables = [_Table.of(problem, index, _NEEDS) for index in indices]
    batches: dict[tuple, list[int]] = {}
    for k, table in enumerate(tables):
        batches.setdefault(table.signature, []).append(k)
    out: list[list[Candidate]] = [[] for _ in indices]
    for ks in batches.values():
        if not tables[ks[0]].groups:
            continue
        batch = _Batch(problem, [tables[k] for k in ks], flats[ks], [kinds[k] for k in ks])
        for j in range(len(tables[ks[0]].groups)):
            for k, candidates in zip(ks, batch.layout(j), strict=True):
                out[k] += candidates
    return out


class _Table:
    """What pricing a table's layouts needs that depends on the table alone, built once per
    table and set of sharding types (kept in `Problem.cache`): its layouts and their rows
    (a structure tables of one `signature` share), and its columns."""

    def __init__(self, p: Problem, groups: list[Group]):
        self.groups = groups
        self.signature = tuple((g.sharding, g.shards, len(g.modes)) for g in groups)
        if not groups:
            return
        shape = _Shape.of(p, self.signature)
        self.templates, self.traffic_rows, self.layout_rows, self.at = (
            shape.templates, shape.traffic_rows, shape.layout_rows, shape.at
        )  # fmt: skip
        ids_emb = np.array([(groups[j].ids, groups[j].emb) for j in shape.step_layouts]).T
        self.scale = np.repeat(ids_emb, 4, axis=0)[..., None]  # [8, T, 1] bytes per unit
        moded = [groups[j] for j in shape.moded]
        zero = np.zeros((len(shape.step_layouts) - len(moded), 1))  # the rows without modes
        self.lookup, self.overlapped, self.exposed = (
            np.concatenate([getattr(g, name) for g in moded] + [zero])
            for name in ("lookup", "overlapped", "exposed")
        )  # [R, 1]
        self.device, self.host = (
            np.concatenate([getattr(g, name) for g in moded]) for name in ("device", "host")
        )  # [modes, 1], in the order of the rows with modes
        self.extra = [_extra(p, g) for g in groups]

    @classmethod
    def of(cls, p: Problem, index: int, kinds: Collection[str]) -> _Table:
        """Table `index`'s, for its layouts of the sharding types `kinds`."""
        key = ("pricing", index, frozenset(kinds))
        if key not in p.cache:
            p.cache[key] = cls(p, [g for g in p.groups[index] if g.sharding in kinds])
        return p.cache[key]

    def units(self, p: Problem) -> np.ndarray:
        """[8, T, W] the traffic templates of its steps (kept: tables share them)."""
        key = ("units", self.templates.tobytes())
        if key not in p.cache:
            p.cache[key] = p.units[:, self.templates]
        return p.cache[key]

    def modes(self, j: int) -> slice:
        """The rows of layout `j`'s modes."""
        return self.at[(j, _NEEDS[self.groups[j].sharding][0][0])]


class _Shape:
    """The rows of a `_Table`, the same for every table of its signature (kept per signature
    in `Problem.cache`): its steps (`_NEEDS` of each layout), the rows with modes first."""

    def __init__(self, signature: tuple[tuple[str, int, int], ...]):
        steps = [
            (j, t, moded)
            for j, (sharding, _, _) in enumerate(signature)
            for t, moded in _NEEDS[sharding]
        ]
        self.templates = np.array([t for _, t, _ in steps], dtype=int)  # [T]
        self.step_layouts = [j for j, _, _ in steps]  # [T] each step's layout
        order = [k for k, step in enumerate(steps) if step[2]]  # the rows with modes first
        order += [k for k, step in enumerate(steps) if not step[2]]
        size = [signature[steps[k][0]][2] if steps[k][2] else 1 for k in order]
        self.traffic_rows = np.repeat(order, size)  # [R] each row's traffic
        self.layout_rows = np.repeat([steps[k][0] for k in order], size)  # [R] its layout
        ends = np.cumsum(size).tolist()
        self.at = {  # (layout, template) -> its rows
            steps[k][:2]: slice(end - n, end) for k, n, end in zip(order, size, ends, strict=True)
        }
        self.moded = [steps[k][0] for k in order if steps[k][2]]  # the layouts of the moded rows

    @classmethod
    def of(cls, p: Problem, signature: tuple[tuple[str, int, int], ...]) -> _Shape:
        key = ("shape", signature)
        if key not in p.cache:
            p.cache[key] = cls(signature)
        return p.cache[key]


def _extra(p: Problem, g: Group) -> np.ndarray | float:
    """What a layout adds to the work besides its rows' steps that depends on its table
    alone: its all-to-all work (table-wise per owner rank [W], table-row-wise per node
    [N, 1], data parallel and row-wise [1]), or column-wise its bytes a pair of ranks
    exchanges (times the chosen ranks' `pair_s`)."""
    if g.sharding == TABLE_WISE:
        return (g.ids + 2 * g.emb) * p.pair_s
    if g.sharding == TABLE_ROW_WISE:  # the same for tables of the same bytes: kept
        key = ("table_row_wise work", g.ids, g.emb)
        if key not in p.cache:
            bytes_per_unit = np.repeat([g.ids, g.emb], 4)[:, None, None, None]
            p.cache[key] = traffic_work(p.node_units[:, :, None, :] * bytes_per_unit, p.topology)
        return p.cache[key]
    if g.sharding == COLUMN_WISE:
        return g.ids + 2 * g.emb
    return (g.ids + 2 * g.emb) * p.everyone_pair_s


class _Batch:
    """K tables of one layout signature priced, each against its plan: every row of their
    `_Table`s as one step [K, R, W]."""

    def __init__(
        self,
        p: Problem,
        tables: list[_Table],
        flats: np.ndarray,
        kinds: Sequence[Counter[str]],
    ):
        self.p, self.tables, K, W = p, tables, len(tables), p.world
        size = len(RANK_TERMS) * W
        terms = flats[:, :size].reshape(K, len(RANK_TERMS), W).swapaxes(0, 1)
        self.load = load = RankTerms(terms[:, :, None, :])  # rows of [K, 1, W]
        self.link_work_s = flats[:, size + LINK_WORK].reshape(K, 1, 1)
        self.const = shared_with_layouts(  # [K, layouts] what every rank pays alike with each
            p, flats[:, size:], kinds, [[g.modes[0] for g in table.groups] for table in tables]
        )
        first = tables[0]

        def stack(name: str) -> np.ndarray:
            values = [getattr(t, name) for t in tables]
            return values[0][None] if K == 1 else np.stack(values)

        units = first.units(p)  # [8, T, W]
        if K == 1:
            traffic = (units * first.scale)[:, None]  # [8, K, T, W]
        else:
            traffic = units[:, None] * np.stack([t.scale for t in tables], axis=1)
        self.step = rank_step(
            dense_s=p.dense_s,
            lookup_s=load.lookup_s + stack("lookup"),
            overlapped_staging_s=load.overlapped_staging_s + stack("overlapped"),
            exposed_staging_s=load.exposed_staging_s + stack("exposed"),
            traffic=load.traffic + traffic,
            topology=p.topology,
            traffic_rows=first.traffic_rows,
        )
        self.core = self.step.core_s  # [K, R, W]
        self.total = self.step.total_s(self.const[:, first.layout_rows, None])
        self.ok = (load.device_memory_bytes + stack("device") <= p.device_limit) & (
            load.host_memory_bytes + stack("host") <= p.host_limit
        )  # [K, modes, W]: whether one more shard of each mode fits each rank
        self._column_wise: dict[int, list[list[Candidate]]] | None = None

    def layout(self, j: int) -> list[list[Candidate]]:
        """[K][M] the candidates of each table's layout `j`."""
        sharding = self.tables[0].groups[j].sharding
        if sharding == COLUMN_WISE:
            if self._column_wise is None:
                self._column_wise = _column_wise(self)
            return self._column_wise[j]
        evaluator = {TABLE_WISE: _table_wise, TABLE_ROW_WISE: _table_row_wise}.get(
            sharding, _everywhere
        )
        return evaluator(self, j)

    def rows(self, j: int, template: int) -> slice:
        return self.tables[0].at[(j, template)]

    def extra(self, j: int) -> np.ndarray:
        """[K, ...] each table's `_extra` of layout `j`."""
        return np.array([t.extra[j] for t in self.tables])

    def candidates(
        self,
        j: int,
        ranks: Callable[[int, int], tuple[int, ...] | None],
        step: list[list[float]],
        work: list[list[float]],
    ) -> list[list[Candidate]]:
        """[K][M]: each mode of layout `j` at `ranks(k, m)` (None: no room) with its `step`
        and `work`."""
        out = []
        for k, table in enumerate(self.tables):
            row = []
            for m, mode in enumerate(table.groups[j].modes):
                where = ranks(k, m)
                fits = where is not None
                row.append(
                    Candidate(mode, where, step[k][m], work[k][m])
                    if fits
                    else _no_room(self, k, mode)
                )
            out.append(row)
        return out


def _everywhere(batch: _Batch, j: int) -> list[list[Candidate]]:
    """Data parallel and row-wise: a shard on every rank."""
    p, at = batch.p, batch.rows(j, EVERYONE)
    work = (
        batch.core[:, at].sum(axis=-1)
        + batch.link_work_s[..., 0]
        + batch.extra(j).reshape(-1, 1)
        + p.world * batch.const[:, j, None]
    ).tolist()
    highest = batch.total[:, at].max(axis=-1).tolist()
    ok = batch.ok[:, batch.tables[0].modes(j)].all(axis=-1)
    everyone = tuple(range(p.world))
    return batch.candidates(j, lambda k, m: everyone if ok[k, m] else None, highest, work)


def _table_wise(batch: _Batch, j: int) -> list[list[Candidate]]:
    """Each mode on every rank at once: each rank's step as the lone owner, every other
    rank's from the consumer terms, which depend only on whether the owner is on its node."""
    p, W = batch.p, batch.p.world
    near, far = batch.total[:, batch.rows(j, NEAR)][:, 0], batch.total[:, batch.rows(j, FAR)][:, 0]
    core0 = batch.core[:, batch.rows(j, NEAR)]  # [K, 1, W] the ranks' own work, without it
    alone = batch.rows(j, ALONE)
    core, owner = batch.core[:, alone], batch.total[:, alone]  # [K, M, W]
    ok = batch.ok[:, batch.tables[0].modes(j)]
    step = np.where(ok, np.maximum(owner, _slowest_other(near, far, p)[:, None, :]), np.inf)
    const = batch.const[:, j, None, None]
    work = (
        core0.sum(axis=-1, keepdims=True) - core0 + core
        + batch.link_work_s + batch.extra(j)[:, None, :] + W * const
    )  # fmt: skip
    best = np.lexsort((owner, np.round(work / TIE_S), np.round(step / TIE_S)), axis=-1)[..., 0]
    K, M = best.shape
    at = (np.arange(K)[:, None], np.arange(M), best)
    fits, best = ok[at].tolist(), best.tolist()
    return batch.candidates(
        j,
        lambda k, m: (best[k][m],) if fits[k][m] else None,
        step[at].tolist(),
        work[at].tolist(),
    )


def _slowest_other(near: np.ndarray, far: np.ndarray, p: Problem) -> np.ndarray:
    """[K, W]: the slowest step among the other ranks when rank r holds a table-wise shard,
    each rank of r's node taking `near` [K, W], the others `far` [K, W]."""
    starts, node = p.node_starts, p.node
    top = np.maximum.reduceat(near, starts, axis=-1)  # [K, N]
    is_top = near == top[:, node]
    alone_on_top = np.add.reduceat(is_top, starts, axis=-1)[:, node] == 1
    below = np.maximum.reduceat(np.where(is_top, -np.inf, near), starts, axis=-1)
    in_node = np.where(is_top & alone_on_top, below[:, node], top[:, node])
    far_top = np.maximum.reduceat(far, starts, axis=-1)  # [K, N]
    elsewhere = np.where(p.same_node_pairs, -np.inf, far_top[:, None, :]).max(axis=-1)
    return np.maximum(in_node, elsewhere[:, node])


def _table_row_wise(batch: _Batch, j: int) -> list[list[Candidate]]:
    """Table-row-wise: the shards on every rank of one node, each node tried; the node whose
    step (then work) is least wins. Output traffic as TorchRec runs it (`reduced_in_node`).

    A rank's terms depend only on whether it holds a shard, not on which node does (whole
    nodes of equal size): each rank is priced as an owner ([K, M, W]) and as a consumer
    ([K, 1, W]), and a node's step is the slowest of its owners and the other nodes'
    consumers."""
    p = batch.p
    owners, consumer = batch.rows(j, NODE_OWNER), batch.rows(j, NODE_CONSUMER)
    per_node = (len(batch.tables), -1, p.nodes, p.world // p.nodes)  # [K, M or 1, N, k]
    owner_max = batch.total[:, owners].reshape(per_node).max(axis=-1).swapaxes(1, 2)
    consumer_max = batch.total[:, consumer].reshape(per_node).max(axis=-1)  # [K, 1, N]
    elsewhere = np.where(p.same_node_pairs, -np.inf, consumer_max).max(axis=-1)  # [K, N]
    totals = np.maximum(owner_max, elsewhere[..., None])  # [K, N, M]
    core = np.where(
        p.same_node[:, None, :] > 0, batch.core[:, None, owners], batch.core[:, None, consumer]
    )  # [K, N, M, W]
    work = (
        core.sum(axis=-1)
        + batch.link_work_s
        + batch.extra(j)  # [K, N, 1]
        + p.world * batch.const[:, j, None, None]
    ).tolist()
    ok = batch.ok[:, batch.tables[0].modes(j)]
    fits = np.logical_and.reduceat(ok, p.node_starts, axis=-1).swapaxes(1, 2)  # [K, N, M]
    totals = np.where(fits, totals, np.inf).tolist()
    best = [  # [K][M] (step, work, node)
        [_best_node(steps, works, m) for m in range(len(steps[0]))]
        for steps, works in zip(totals, work, strict=True)
    ]
    return batch.candidates(
        j,
        lambda k, m: p.node_ranks[best[k][m][2]] if math.isfinite(best[k][m][0]) else None,
        [[b[0] for b in row] for row in best],
        [[b[1] for b in row] for row in best],
    )


def _best_node(steps: list[list[float]], works: list[list[float]], m: int) -> tuple:
    """(step, work, node) of the node of least step (then work) for mode `m`, the nodes
    compared in order: `steps`, `works` [N][M]."""
    best_step, best_work, best_node = math.inf, math.inf, 0
    for n, (step_n, work_n) in enumerate(zip(steps, works, strict=True)):
        step_s, work_s = step_n[m], work_n[m]
        tie = math.isfinite(step_s) and step_s <= best_step + TIE_S
        if step_s < best_step - TIE_S or (tie and work_s < best_work - TIE_S):
            best_step, best_work, best_node = step_s, work_s, n
    return best_step, best_work, best_node


def _column_wise(batch: _Batch) -> dict[int, list[list[Candidate]]]:
    """Per column-wise layout: the shards go to the S ranks where one shard alone would cost
    least; then priced exactly, every column-wise layout's modes as the rows of one step."""
    p, first, load = batch.p, batch.tables[0], batch.load
    layouts = [j for j, g in enumerate(first.groups) if g.sharding == COLUMN_WISE]
    owned, chosen = [], []
    for j in layouts:
        owner, ok = batch.total[:, batch.rows(j, ALONE)], batch.ok[:, first.modes(j)]
        chosen.append(np.lexsort((owner, ~ok), axis=-1)[..., : first.groups[j].shards])
        is_owner = np.zeros(owner.shape)  # [K, M, W]
        K, M, _ = owner.shape
        is_owner[np.arange(K)[:, None, None], np.arange(M)[:, None], chosen[-1]] = 1.0
        owned.append(is_owner)
    is_owner = np.concatenate(owned, axis=1)  # [K, modes, W]

    def column(name: str) -> np.ndarray:  # [K, modes, 1] (or [8, K, modes, 1] for "scale")
        values = [[getattr(t.groups[j], name) for j in layouts] for t in batch.tables]
        return np.stack([np.concatenate(v) for v in values])

    scale = np.array(
        [[(t.groups[j].ids, t.groups[j].emb) for j in layouts] for t in batch.tables]
    )  # [K, layouts, 2]
    sizes = [len(first.groups[j].modes) for j in layouts]
    scale = np.repeat(np.repeat(scale, sizes, axis=1).transpose(2, 0, 1), 4, axis=0)[..., None]
    step = rank_step(
        dense_s=p.dense_s,
        lookup_s=load.lookup_s + column("lookup") * is_owner,
        overlapped_staging_s=load.overlapped_staging_s + column("overlapped") * is_owner,
        exposed_staging_s=load.exposed_staging_s + column("exposed") * is_owner,
        traffic=load.traffic + traffic_units(is_owner, p.topology, reduced=False) * scale,
        topology=p.topology,
    )
    out, start = {}, 0
    for j, is_owner_j, chosen_j in zip(layouts, owned, chosen, strict=True):
        at = slice(start, start + is_owner_j.shape[1])
        start = at.stop
        out[j] = _spread(batch, j, RankStep(*(part[:, at] for part in step)), is_owner_j, chosen_j)
    return out


def _spread(
    batch: _Batch, j: int, step: RankStep, is_owner: np.ndarray, chosen: np.ndarray
) -> list[list[Candidate]]:
    """Column-wise layout `j`'s candidates from its rows' `step` [K, M, W], its shards on
    `is_owner` [K, M, W] (the ranks `chosen` [K, M, S])."""
    p = batch.p
    const = batch.const[:, j, None]  # [K, 1]
    pair_s = np.stack([plan @ p.pair_s for plan in is_owner])  # [K, M], as one plan's rows
    work = (
        step.core_s.sum(axis=-1)
        + batch.link_work_s[..., 0]
        + batch.extra(j)[:, None] * pair_s
        + p.world * const
    ).tolist()
    highest = step.total_s(const[..., None]).max(axis=-1).tolist()
    shards = batch.tables[0].groups[j].shards
    fits = (batch.ok[:, batch.tables[0].modes(j)].sum(axis=-1) >= shards).tolist()
    ranks = np.sort(chosen, axis=-1).tolist()
    return batch.candidates(
        j, lambda k, m: tuple(ranks[k][m]) if fits[k][m] else None, highest, work
    )


def _no_room(batch: _Batch, k: int, mode: Mode) -> Candidate:
    """A candidate that does not fit, saying which memory is short on its ranks (plan `k`)."""
    t, p, load = mode.terms, batch.p, batch.load
    sharding, shards = mode.placement.sharding, mode.placement.shards
    needed = p.world if sharding in (DATA_PARALLEL, ROW_WISE) else shards
    reason = f"no {needed} rank(s) with room for a shard"
    for kind, used, need, limit in (
        ("device", load.device_memory_bytes[k, 0], t.device_memory_bytes, p.device_limit),
        ("host", load.host_memory_bytes[k, 0], t.host_memory_bytes, p.host_limit),
    ):
        free = np.sort(limit - used)[-needed]  # the needed-th most free rank's
        if need > free:
            reason = f"needs {gb(need)} {kind} memory per shard, {gb(max(free, 0))} free"
            break
    return Candidate(mode, (), math.inf, math.inf, reason=reason)
