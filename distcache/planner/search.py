"""The solver's search: greedy passes that place the tables one by one, then a local search
that re-places one or two tables at a time while the modelled (step, work) drops.

The steps (see `solver.py`'s docstring for the whole algorithm):

- `starts`: greedy passes, longest processing time first (tables by decreasing least work,
  each at the candidate `_pick` prefers); when memory binds, three more passes (ties toward
  less memory, memory first, smallest tables first); when each sharding type a plan uses costs
  at least 1 % of the step, the greedy restricted to one type; and the seed plans given
  (the uniform baselines) that fit.
- `improve`: local search from the starts, best first, within a budget of moves shared by
  all starts (`SolverOptions.max_moves`), so the same inputs give the same plan whatever the
  machine's load; `time_limit_s` only stops a runaway search. Its moves are priced in chunks
  (`MOVE_CHUNK`), each against the state as it is, up to the first kept: the same picks as one
  move at a time, since a move not kept leaves the state bit for bit as it was.

Example::

    problem = Problem(workload, topology, SolverOptions())
    best = improve(starts(problem, seeds=()), max_moves=1000, time_limit_s=60.0)
    plan = best.plan("mine", explanations={})
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable

import numpy as np

from distcache.constants import HOT_ALL
from distcache.errors import DistcacheConfigError
from distcache.planner.candidates import TIE_S, Candidate, Mode, Problem, gb, kind_text
from distcache.planner.cost import global_terms
from distcache.planner.pricing import cut_as_enough, evaluate, price_tables
from distcache.planner.ranks import RankTerms, Traffic
from distcache.planner.state import Footprint, State
from distcache.planner.types import HOST_CACHED, TABLE_WISE, Plan

log = logging.getLogger(__name__)

# Moves of the local search priced together (speculatively: `_first_kept`). On the 1,000-table
# plan on 128 ranks here the search took 0.47-0.63 s with 8, 0.56-0.71 s with 16 and 0.50-0.65 s
# with 32, against 0.68-0.85 s one move at a time (2 runs each; the machine's noise is as large).
MOVE_CHUNK = 8
_RTOL = 1e-5  # relative: estimated steps closer than this are equal when picking a candidate
# Greedy passes: by work, picking for time; then, when memory binds (caches were needed), ties
# broken toward less memory, memory first, and the smallest tables first.
PASSES = ("time", "time_memory", "memory", "small_first")


def _pick(
    candidates: list[Candidate],
    remaining_s: float,
    world: int,
    prefer: str,
    allowed: Callable[[Candidate], bool] | None = None,
) -> Candidate | None:
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
    cutoff = min(c.estimate_s for c in permitted) * (1 + _RTOL) + TIE_S
    near = [c for c in permitted if c.estimate_s <= cutoff]

    def key(c: Candidate) -> tuple:
        staging = c.mode.terms.staging_bytes_per_step * c.mode.placement.shards
        tail = (_memory(c), staging) if prefer == "time_memory" else (staging, _memory(c))
        return (round(c.work_s / TIE_S), *tail, c.estimate_s)

    return min(near, key=key)


def _memory(c: Candidate) -> float:
    """Device bytes a candidate takes over all its ranks."""
    return c.mode.terms.device_memory_bytes * c.mode.placement.shards


def _greedy(problem: Problem, prefer: str, kinds: Collection[str] | None = None) -> State:
    """Tables by decreasing least work (least memory with `prefer` 'memory'; smallest whole
    table first with 'small_first', which then picks as 'time': the small tables take the device
    memory, the large ones the caches), each at the candidate `_pick` prefers among those that
    leave enough memory, summed over ranks, for the least memory of the tables left; only
    sharding types in `kinds`, if given."""
    state, world = State(problem), problem.world
    tables = range(len(problem.tables))
    if prefer == "memory":
        order = sorted(tables, key=lambda i: -problem.least_memory[i][0])
    elif prefer == "small_first":
        workload = problem.workload

        def size(i: int) -> int:
            return problem.tables[i].rows * workload.row_bytes(problem.tables[i])

        order = sorted(tables, key=size)
        prefer = "time"
    else:
        order = sorted(tables, key=lambda i: -problem.work[i])
    remaining = sum(problem.work)
    reserved = np.array(problem.least_memory, dtype=np.float64).sum(axis=0)  # (device, host)
    limits = np.array([problem.device_limit, problem.host_limit], dtype=np.float64) * world
    for index in order:
        remaining -= problem.work[index]
        reserved -= problem.least_memory[index]
        used = (state.load.device_memory_bytes.sum(), state.load.host_memory_bytes.sum())
        free = limits - np.array(used)

        def allowed(c: Candidate, room: np.ndarray = free - reserved) -> bool:
            t = c.mode.terms
            return t.device_memory_bytes * c.mode.placement.shards <= room[0] and (
                t.host_memory_bytes * c.mode.placement.shards <= room[1]
            )

        def enough(c: Candidate, rest: float = remaining) -> bool:
            return allowed(c) and c.step_s <= (c.work_s + rest) / world + TIE_S

        candidates = evaluate(state, index, enough, kinds)
        choice = _pick(candidates, remaining, world, prefer, allowed)
        if choice is None:
            raise _no_fit_error(state, index)
        state.add(index, choice.mode, choice.ranks)
    return state


def _no_fit_error(state: State, index: int) -> DistcacheConfigError:
    problem, table = state.p, state.p.tables[index]
    reasons: dict[tuple, str] = {}
    for c in problem.rejects[index] + evaluate(state, index):
        p = c.mode.placement
        kind = (p.sharding, p.shards, p.storage)
        if kind not in reasons or reasons[kind].startswith("a cache of"):
            reasons[kind] = c.reason  # a memory reason says more than a too-small cache
    listed = "; ".join(f"{kind_text(*k)}: {r}" for k, r in reasons.items())
    return DistcacheConfigError(
        f"no placement of table {table.name!r} ({table.rows} rows x {table.dim}) fits "
        f"{problem.topology.name} ({gb(problem.device_limit)} device, "
        f"{gb(problem.host_limit)} host memory per rank): {listed or 'no allowed mode'}"
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
    state: State, budget: _MoveBudget, moves: int, singles: int = 16, pairs: int = 6
) -> None:
    """Local search until no move lowers (step, work) or `moves` tries are spent: re-place one
    of the `singles` tables loading the slowest rank most; failing that, re-place one of the
    `pairs` heaviest together with any other table (either first), which frees memory for a
    swap."""
    topology = state.p.topology
    intra, inter = 1 / topology.intra_node_bw_bytes_per_s, 1 / topology.inter_node_bw_bytes_per_s
    link = Traffic(intra, inter, intra, inter)
    weight = RankTerms.stack(  # [TERMS] rough seconds per unit of each rank term
        lookup_s=1.0,
        overlapped_staging_s=1.0,
        exposed_staging_s=1.0,
        ids=link,
        emb=link,
        device_memory_bytes=0.0,
        host_memory_bytes=0.0,
    ).values
    stop = budget.moves - moves  # the budget's level at which this start's share is spent
    while budget.moves > stop and not budget.timed_out:
        slowest = int(np.argmax(state.totals()))
        heavy = [
            i
            for _, i in sorted(
                ((float(weight @ c.values[:, slowest]), i) for i, c in enumerate(state.contrib)),
                reverse=True,
            )
        ]
        candidates = [(i,) for i in heavy[:singles]]
        candidates += [(i, j) for i in heavy[:pairs] for j in heavy[: 4 * pairs] if i != j]
        if not _first_kept(state, candidates, budget, stop):
            return


def _first_kept(state: State, moves: list[tuple[int, ...]], budget: _MoveBudget, stop: int) -> bool:
    """Try `moves` in order until one is kept, each taking a move of the budget (down to
    `stop`); whether one was. The moves of a chunk are priced together against the state as
    it is (`_speculate`): a move that is not kept leaves the state as it was, so each is
    priced as one move at a time would price it, and the chunk ends at the first kept."""
    at = 0
    while at < len(moves) and budget.moves > stop:
        chunk = moves[at : at + min(MOVE_CHUNK, budget.moves - stop)]
        for move, picks in zip(chunk, _speculate(state, chunk), strict=True):
            at += 1
            if not budget.take(budget.moves - stop):
                return False
            if _try_move(state, move, picks):
                return True
    return False


_Pick = tuple[Mode, tuple[int, ...], Footprint]


def _speculate(state: State, moves: list[tuple[int, ...]]) -> list[list[_Pick]]:
    """Where each of `moves` would re-place its tables, each move alone against the state:
    its tables taken out, then placed one after the other at their best (the last one's
    spread layouts dropped where a table-wise candidate leaves the step at most the state's
    without it, as `evaluate`'s shortcut does, which only holds with nothing left to place).
    The picks of a move stop at a table with none. Each step's tables are priced together."""
    p = state.p
    flats, kinds = [], []
    for move in moves:
        flat, used = state.flat, state.kinds.copy()
        for index in move:
            flat = flat - state.contrib[index].flat
            used[state.contrib[index].collectives] -= 1
        flats.append(flat)
        kinds.append(used)
    picks: list[list[_Pick]] = [[] for _ in moves]
    for k in range(max(len(m) for m in moves)):
        going = [i for i, m in enumerate(moves) if len(m) > k and len(picks[i]) == k]
        if not going:
            break
        if k:  # the move's earlier tables placed
            for i in going:
                flats[i] = flats[i] + picks[i][-1][2].flat
                kinds[i][picks[i][-1][2].collectives] += 1
        indices = [moves[i][k] for i in going]
        stacked = np.stack([flats[i] for i in going])
        floors = [step for step, _, _ in state.scores(stacked, [kinds[i] for i in going])]
        priced = price_tables(p, indices, stacked, [kinds[i] for i in going])
        for i, candidates, floor in zip(going, priced, floors, strict=True):
            rest = sum(p.work[j] for j in moves[i][k + 1 :])
            if k == len(moves[i]) - 1:
                candidates = cut_as_enough(candidates, lambda c, f=floor: c.step_s <= f + TIE_S)
            best = _pick(candidates, rest, p.world, "time")
            if best is not None:
                (footprint,) = state.footprints((best.mode,), best.ranks)
                picks[i].append((best.mode, best.ranks, footprint))
    return picks


def _try_move(state: State, tables: tuple[int, ...], picks: list[_Pick]) -> bool:
    """Re-place `tables` at `picks` (`_speculate`); keep it if (step, work) drops, else put
    the state back as it was."""
    current, before = state.score(), state.flat.copy()
    old = [state.remove(i) for i in tables]
    for index, (mode, ranks, footprint) in zip(tables, picks, strict=False):
        state.add(index, mode, ranks, footprint)
    if len(picks) == len(tables) and better_state(state.score(), current):
        return True
    for index in tables[: len(picks)]:
        state.remove(index)
    for index, removed in zip(tables, old, strict=True):
        state.add(index, *removed)
    state.flat[:] = before  # as it was, without the rounding of the removes and adds
    return False


def better_state(new: tuple[float, float], old: tuple[float, float], rtol: float = 1e-7) -> bool:
    """Lower step, or the same step and lower work (by more than a rounding error)."""
    if new[0] < old[0] * (1 - rtol):
        return True
    return new[0] <= old[0] * (1 + rtol) and new[1] < old[1] * (1 - rtol)


def _load_plan(problem: Problem, plan: Plan) -> State | None:
    """A state holding `plan` (a seed); None when it does not fit."""
    state = State(problem)
    placed = []
    for index, (table, tp) in enumerate(zip(problem.tables, plan.tables, strict=True)):
        placement = tp.placement
        if placement.hot_rows or placement.hot_reduce != HOT_ALL:  # a menu mode: no replica
            placement = dataclasses.replace(placement, hot_rows=0, hot_reduce=HOT_ALL)
        mode = problem.known[index].get(placement) or problem.mode(table, placement)
        placed.append((mode, tp.ranks))
    # The footprints of the tables on the same ranks made together (a uniform plan puts many
    # tables on each rank set), then added in order, as one table at a time would.
    together: dict[tuple, list[int]] = {}
    for index, (mode, ranks) in enumerate(placed):
        together.setdefault((ranks, mode.terms.reduced_in_node), []).append(index)
    footprints = {}
    for (ranks, _), indices in together.items():
        made = state.footprints([placed[i][0] for i in indices], ranks)
        footprints.update(zip(indices, made, strict=True))
    for index, (mode, ranks) in enumerate(placed):
        if not mode.terms.fits_working_set:
            return None
        state.add(index, mode, ranks, footprints[index])
    # (Each table adds memory, none frees any: the plan fits if the whole of it does.)
    return state if state.fits() else None


def starts(problem: Problem, seeds: Iterable[Plan]) -> list[State]:
    """The local search's starts: the greedy passes (more when memory binds), the greedy
    restricted to one sharding type where types are costly (`_single_type_starts`), and the
    `seeds` that fit.

    Raises:
        DistcacheConfigError: the first greedy pass's, when no start fits.
    """
    states, error = [], None
    for prefer in PASSES:
        try:
            states.append(_greedy(problem, prefer))
        except DistcacheConfigError as exc:
            error = error or exc
        cached = any(m.placement.storage == HOST_CACHED for s in states for m, _ in s.placed)
        if states and not cached:
            break  # memory was not binding: the other passes would find the same plan
    states += _single_type_starts(problem, states)
    for plan in seeds:
        seed = _load_plan(problem, plan)
        states += [seed] if seed is not None else []
    if not states:
        raise error
    return states


def _single_type_starts(problem: Problem, states: list[State]) -> list[State]:
    """Greedy starts with every table of one sharding type, when each type a plan uses costs
    at least 1 % of the best start's step (its latencies and overhead, `cost.global_terms`):
    moving one table at a time, the local search cannot drop a type that many tables use."""
    if not states:
        return []
    best = min(s.score()[0] for s in states)
    workload, topology = problem.workload, problem.topology
    per_type = global_terms(workload, topology, 0.0, {TABLE_WISE}).shared_s
    per_type -= global_terms(workload, topology, 0.0, ()).shared_s
    if per_type < 0.01 * best:
        return []
    out = []
    for sharding in problem.options.shardings:
        for prefer in PASSES:  # as `starts`' passes
            try:
                out.append(_greedy(problem, prefer, kinds=(sharding,)))
            except DistcacheConfigError:
                continue  # no fitting placement of this type for some table, this way
            if not any(m.placement.storage == HOST_CACHED for m, _ in out[-1].placed):
                break  # memory did not bind: the other passes would find the same plan
    return out


def improve(states: list[State], *, max_moves: int, time_limit_s: float) -> State:
    """The best state after a local search from each of `states` (distinct ones, best first,
    the best with twice the others' share of `max_moves`; starts too far behind the best are
    not searched), with a wall-time safety limit `time_limit_s`."""
    # Duplicates dropped: a table's modes are equal where their placements are (terms follow
    # placement), whose hash is a third of the mode's.
    unique = {tuple((m.placement, r) for m, r, *_ in s.placed): s for s in states}
    states = sorted(unique.values(), key=lambda s: s.score())
    budget = _MoveBudget(max_moves, time_limit_s)
    for i, state in enumerate(states):
        if state.score()[0] > 1.25 * states[0].score()[0]:
            break  # too far behind to overtake the best
        share = budget.moves * (2 if i == 0 else 1) // (len(states) - i + (i == 0))
        _improve(state, budget, share, pairs=6 if i == 0 else 2)
    if budget.timed_out:
        log.warning(
            "solve: the local search hit its %.0f s safety limit; the plan now depends on this "
            "machine's speed (lower SolverOptions.max_moves for a deterministic plan)",
            time_limit_s,
        )
    log.debug("solve: %d moves left", budget.moves)
    return min(states, key=lambda s: s.score())
