"""The solver's last stage: how many of each sharded table's likeliest rows to replicate on
every rank (`TablePlan.hot_rows`), chosen by the modelled step like every other choice.

A replica of a table's H likeliest rows takes their share of its lookups off the all-to-all
and off the shards (and their cache), and costs every rank the replica's memory, its lookups,
its masked update, and the sum of its gradient over the ranks: an all-reduce of all H rows,
or an all-gather of the rows each rank touched (`TablePlan.hot_reduce`; `cost.py`'s
docstring prices each). Once the placements are chosen, every sharded table first takes the
same share of its lookups (each of `SolverOptions.hot_row_shares`, or none), reduced the same
way, the best of these kept: the replicas share their collectives, whose latency no single
table's saving may pay for. Then each table tries H = 0 and the H that takes each share, each
reduced both ways, keeping the one with the least step (then work) that fits; a second pass
runs when the first changed anything, since one table's replica changes what the others'
would save. The tables of a pass are priced in chunks against the state as it is, again
from the first that moves (`CHUNK`): the choices are those of one table at a time.
Placements, caches and ranks stay as chosen: the replicas are a refinement, not a search of
their own.

Example::

    notes = choose_hot_rows(state, shares=(0.5, 0.9))
    print(notes.get(0, "no hot rows"))
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Sequence

import numpy as np

from distcache.constants import HOT_ALL, HOT_REDUCE, HOT_TOUCHED
from distcache.planner.binned import BinnedProfile, table_access
from distcache.planner.candidates import Mode
from distcache.planner.search import better_state as _better
from distcache.planner.shards import reduced_as, shard_terms
from distcache.planner.state import Footprint, State
from distcache.planner.types import DATA_PARALLEL, Placement

PASSES = 2
# Tables priced together (speculatively: `choose_hot_rows`). Measured on the 1,000-table plan
# on 128 ranks here: 8 took the stage 0.82 x the time of one at a time, 16 and 32 1.4-1.5 x (their
# trials, 9 KB a row, outgrow the core's cache).
CHUNK = 8


def _replica_rows(state: State, index: int, share: float) -> int:
    """The fewest likeliest rows of table `index` taking at least `share` of its lookups; 0
    when that is every row (a replica of the whole table is data parallel)."""
    table = state.p.tables[index]
    rows = table_access(table).rows_for_mass(share)
    return rows if rows < table.rows else 0


def _sharded(state: State) -> list[int]:
    """The placed tables a replica may serve (all but data-parallel ones). (A device-stored
    sequence table with one is priced on distcache's kernel: `shards.shard_terms`.)"""
    return [
        i
        for i, placed in enumerate(state.placed)
        if placed and placed[0].placement.sharding != DATA_PARALLEL
    ]


def with_hot_rows(
    state: State, index: int, mode: Mode, hot_rows: int, hot_reduce: str = HOT_ALL
) -> Mode:
    """`mode` with `hot_rows` replicated, reduced as `hot_reduce`, its terms priced again."""
    p = state.p
    placement = dataclasses.replace(mode.placement, hot_rows=hot_rows, hot_reduce=hot_reduce)
    return Mode(placement, shard_terms(p.tables[index], p.workload, p.topology, placement))


def choose_hot_rows(
    state: State, shares: Sequence[float], noted: Collection[int] | None = None
) -> dict[int, str]:
    """Give each sharded table of the placed `state` its best replica (in place); returns a
    note per table that was offered one (of those in `noted`, if given: the tables explained):
    the replica chosen and the steps of the others."""
    notes: dict[int, str] = {}
    if not shares:
        return notes
    variants = _Variants(state, shares)
    _same_share_everywhere(state, shares, variants)
    tried: dict[int, list[tuple[int, str, float | None]]] = {}  # the last pass's: the notes'
    for _ in range(PASSES):
        changed = False
        sharded, at = _sharded(state), 0
        while at < len(sharded):
            # Speculatively, a chunk's tables priced together against the state as it is; in
            # order, each keeps its best. The first that moves changes the state for those
            # after it, which are priced again from there: as one table at a time would.
            chunk = sharded[at : at + CHUNK]
            tries = [_tries(state, index, variants) for index in chunk]
            now, scores = state.trial_scores(
                [(index, t[2]) for index, t in zip(chunk, tries, strict=True)]
            )
            for index, table_tries, table_scores in zip(chunk, tries, scores, strict=True):
                at += 1
                tried[index], moved = _choose_one(state, index, table_tries, now, table_scores)
                changed |= moved
                if moved:
                    break
        if not changed:
            break
    for index, steps in tried.items():
        if noted is not None and index not in noted:
            continue
        chosen = state.placed[index][0].placement
        notes[index] = _note(table_access(state.p.tables[index]), chosen, steps)
    return notes


class _Variants:
    """Each table's mode with each replica, and its footprint, priced once for the whole stage
    (a table's placement and ranks do not change here, so its variants are the same in every
    pass)."""

    def __init__(self, state: State, shares: Sequence[float]):
        self.state = state
        self.modes: dict[tuple[int, int, str], Mode] = {}
        self.footprints: dict[tuple[int, int, str], Footprint] = {}
        # Per sharded table: the replica of each share (`_replica_rows`), and the sizes tried.
        self.rows: dict[int, list[int]] = {}
        self.counts: dict[int, list[int]] = {}
        for index in _sharded(state):
            self.rows[index] = [_replica_rows(state, index, share) for share in shares]
            self.counts[index] = sorted({0, *self.rows[index]})
            mode = state.placed[index][0]
            if not mode.placement.hot_rows:  # placed without a replica: its H = 0 variant
                self.modes[index, 0, HOT_ALL] = mode
                self.footprints[index, 0, HOT_ALL] = state.contrib[index]

    def placed(self, index: int, modes: Sequence[Mode]) -> list[Footprint]:
        """The footprint of table `index` placed on its ranks as each of `modes` (its
        variants), those not priced yet priced together."""
        return self.placed_many([(index, modes)])[0]

    def placed_many(self, requests: Sequence[tuple[int, Sequence[Mode]]]) -> list[list[Footprint]]:
        """`placed` of each (table, modes) of `requests`; those not priced yet priced together
        where their tables sit on the same ranks (a footprint's values do not depend on what
        is priced beside it)."""
        together: dict[tuple, dict[tuple[int, int, str], Mode]] = {}
        keys = []
        for index, modes in requests:
            table_keys = [(index, m.placement.hot_rows, m.placement.hot_reduce) for m in modes]
            keys.append(table_keys)
            ranks = self.state.placed[index][1]
            for key, mode in zip(table_keys, modes, strict=True):
                if key not in self.footprints:
                    group = together.setdefault((ranks, mode.terms.reduced_in_node), {})
                    group[key] = mode
        for (ranks, _), fresh in together.items():
            priced = self.state.footprints(list(fresh.values()), ranks)
            self.footprints.update(zip(fresh, priced, strict=True))
        return [[self.footprints[k] for k in table_keys] for table_keys in keys]

    def get(self, index: int, mode: Mode, hot_rows: int, hot_reduce: str) -> Mode:
        """`with_hot_rows(state, index, mode, hot_rows, hot_reduce)`: a replica reduced
        otherwise than 'all' from the one reduced 'all' (only its `hot_*` terms differ)."""
        key = (index, hot_rows, hot_reduce)
        if key in self.modes:
            return self.modes[key]
        if hot_reduce == HOT_ALL or not hot_rows:
            variant = with_hot_rows(self.state, index, mode, hot_rows, hot_reduce)
        else:
            whole = self.get(index, mode, hot_rows, HOT_ALL)
            p = self.state.p
            terms = reduced_as(whole.terms, p.tables[index], p.workload, p.topology, hot_reduce)
            variant = Mode(dataclasses.replace(whole.placement, hot_reduce=hot_reduce), terms)
        self.modes[key] = variant
        return variant


def _same_share_everywhere(state: State, shares: Sequence[float], variants: _Variants) -> None:
    """Give every sharded table the replica taking the same share of its lookups, reduced the
    same way: each share and reduction tried (and none), the best kept. The combinations are
    priced together (`State.scores`): the state with every sharded table's footprint swapped
    for its variant's, as removing and adding them one at a time would leave it."""
    sharded = _sharded(state)
    if not sharded:
        return
    combos = [(s, reduce) for s in range(len(shares)) for reduce in HOT_REDUCE]  # (share, how)
    requests = []  # each sharded table's mode in each combination
    for i in sharded:
        mode, rows = state.placed[i][0], variants.rows[i]
        requests.append((i, [variants.get(i, mode, rows[s], r) for s, r in combos]))
    per_table = [  # and its footprint
        list(zip(modes, footprints, strict=True))
        for (_, modes), footprints in zip(requests, variants.placed_many(requests), strict=True)
    ]
    tried = list(zip(*per_table, strict=True))  # per combination: each table's (mode, footprint)
    rest = state.flat.copy()  # the state without the sharded tables
    for i in sharded:
        rest -= state.contrib[i].flat
    rest_kinds = state.kinds - Counter(state.contrib[i].collectives for i in sharded)
    flats, kinds = [state.flat], [state.kinds]
    for combo in tried:
        flat = rest.copy()
        for _, footprint in combo:
            flat += footprint.flat
        flats.append(flat)
        kinds.append(rest_kinds + Counter(footprint.collectives for _, footprint in combo))
    (step, work, fits), *scores = state.scores(np.stack(flats), kinds)
    best, best_score = None, (step, work) if fits else None
    for combo, (step, work, fits) in zip(tried, scores, strict=True):
        if fits and (best_score is None or _better((step, work), best_score)):
            best, best_score = combo, (step, work)
    if best is None:  # no replica everywhere beats none
        return
    for i, (mode, footprint) in zip(sharded, best, strict=True):
        ranks = state.placed[i][1]
        state.remove(i)
        state.add(i, mode, ranks, footprint)


def _tries(
    state: State, index: int, variants: _Variants
) -> tuple[list[tuple[int, str]], list[Mode], list[Footprint]]:
    """The replicas table `index` tries ((hot rows, reduction) each, its current one among
    them), their modes and their footprints (the current one's as placed)."""
    mode, now = state.placed[index][0], state.contrib[index]
    counts = variants.counts[index]
    tries = [(h, r) for h in counts for r in (HOT_REDUCE if h else (HOT_ALL,))]
    now_key = (mode.placement.hot_rows, mode.placement.hot_reduce)
    modes = [mode if key == now_key else variants.get(index, mode, *key) for key in tries]
    fresh = iter(variants.placed(index, [m for m in modes if m is not mode]))
    return tries, modes, [now if m is mode else next(fresh) for m in modes]


def _choose_one(
    state: State,
    index: int,
    tries: tuple[list[tuple[int, str]], list[Mode], list[Footprint]],
    now_score: tuple[float, float] | None,
    scores: list[tuple[float, float] | None],
) -> tuple[list[tuple[int, str, float | None]], bool]:
    """Keep the best of the replicas `tries` (`_tries`) for table `index`, whose states score
    `scores` and the state as it is `now_score` (`State.trial_scores`). ((hot rows,
    reduction, step or None where it does not fit) of each replica tried, whether the table
    changed)."""
    (mode, ranks), keys, modes, footprints = state.placed[index], *tries
    tried: list[tuple[int, str, float | None]] = []
    best, best_score, kept = mode, now_score, state.contrib[index]
    for (hot, reduce), variant, footprint, score in zip(
        keys, modes, footprints, scores, strict=True
    ):
        tried.append((hot, reduce, score[0] if score else None))
        if score is not None and (best_score is None or _better(score, best_score)):
            best, best_score, kept = variant, score, footprint
    if best is not mode:
        state.remove(index)
        state.add(index, best, ranks, kept)
    return tried, best is not mode


def _note(
    access: BinnedProfile, best: Placement, tried: list[tuple[int, str, float | None]]
) -> str:
    """The replica chosen, then the step of each other replica tried."""
    others = ", ".join(
        f"{h} ({100 * access.head_mass(h):.3g}% of lookups{_gathered(h, r)}): "
        + (f"{s * 1e3:.4g} ms/step" if s is not None else "does not fit")
        for h, r, s in tried
        if (h, r) != (best.hot_rows, best.hot_reduce if best.hot_rows else HOT_ALL)
    )
    chosen = (
        f"{best.hot_rows} hot rows replicated ({100 * access.head_mass(best.hot_rows):.3g}% of "
        f"lookups{_gathered(best.hot_rows, best.hot_reduce)})"
        if best.hot_rows
        else "no hot rows"
    )
    return f"{chosen}; tried {others}"


def _gathered(hot_rows: int, hot_reduce: str) -> str:
    """How a replica's gradient is summed, where it is not all its rows all-reduced."""
    return "; touched rows all-gathered" if hot_rows and hot_reduce == HOT_TOUCHED else ""
