"""The solver's explanations: per table, the chosen placement and the best placement of every
other kind (sharding, shard count, storage) with the step the plan would have, or why it does
not fit — what `Plan.explanations` holds.

Each table's modes are priced against the plan without it, as `evaluate` would, the tables
of a chunk together (`pricing.price_tables`).

Example::

    print(explain(best_state)["t0"])
    # table_wise on rank 3, device: 0.417 ms/step, adds 0.0312 ms of rank time; rejected: ...
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from distcache.planner.candidates import Candidate, Mode
from distcache.planner.pricing import price_tables
from distcache.planner.state import State

CHUNK = 64  # tables priced together: their plans' terms, [CHUNK, TERMS, W], stay small


def explain(state: State, indices: Sequence[int] | None = None) -> dict[str, str]:
    """Per table (those of `indices`, in order; default every table): the chosen placement
    and the best of every other kind (sharding, shards, storage) with the step the plan would
    have, or why it does not fit."""
    p, out = state.p, {}
    indices = range(len(p.tables)) if indices is None else indices
    for start in range(0, len(indices), CHUNK):
        chunk = indices[start : start + CHUNK]
        placed, without, after, kinds_without, kinds_after = [], [], [], [], []
        for index in chunk:  # each table out and back in, as `remove` and `add` leave the plan
            mode, ranks, contrib = state.remove(index)
            without.append(state.flat.copy())
            kinds_without.append(Counter(state.kinds))
            state.add(index, mode, ranks, contrib)
            after.append(state.flat.copy())
            kinds_after.append(Counter(state.kinds))
            placed.append((mode, ranks))
        candidates = price_tables(p, chunk, np.stack(without), kinds_without)
        bare = state.scores(np.stack(without), kinds_without)
        full = state.scores(np.stack(after), kinds_after)
        for j, index in enumerate(chunk):
            (mode, ranks), (step, total, _) = placed[j], full[j]
            others = candidates[j] + p.rejects[index]
            out[p.tables[index].name] = _text(mode, ranks, others, step, total, bare[j][1])
    return out


def _text(
    mode: Mode,
    ranks: tuple[int, ...],
    candidates: list[Candidate],
    step: float,
    total: float,
    without: float,
) -> str:
    """The chosen placement, then the best candidate of every other kind."""
    best: dict[tuple, Candidate] = {}
    for c in candidates:
        p = c.mode.placement
        kind = (p.sharding, p.shards, p.storage)
        # (A table's modes are equal where their placements are: terms follow placement.)
        if (p, c.ranks) != (mode.placement, ranks) and (
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
    return chosen + ("; rejected: " + ", ".join(rejected) if rejected else "")


def _cost_text(step_s: float, added_s: float) -> str:
    return f"{step_s * 1e3:.3f} ms/step, adds {added_s * 1e3:.3g} ms of rank time"


def _rank(c: Candidate) -> tuple:
    """Order within a kind: fitting by cost, then a memory reason before a too-small cache."""
    return (not c.fits, c.step_s, c.work_s, c.reason.startswith("a cache of"))
