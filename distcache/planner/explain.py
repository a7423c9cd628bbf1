"""The solver's explanations: per table, the chosen placement and the best placement of every
other kind (sharding, shard count, storage) with the step the plan would have, or why it does
not fit — what `Plan.explanations` holds.

Example::

    print(explain(best_state)["t0"])
    # table_wise on rank 3, device: 0.417 ms/step, adds 0.0312 ms of rank time; rejected: ...
"""

from __future__ import annotations

from distcache.planner.candidates import Candidate
from distcache.planner.pricing import State, evaluate


def explain(state: State) -> dict[str, str]:
    """Per table: the chosen placement and the best of every other kind (sharding, shards,
    storage) with the step the plan would have, or why it does not fit."""
    p, out = state.p, {}
    for index, table in enumerate(p.tables):
        mode, ranks, contrib = state.remove(index)
        without = state.score()[1]
        candidates = evaluate(state, index) + p.rejects[index]
        state.add(index, mode, ranks, contrib)
        step, total = state.score()
        best: dict[tuple, Candidate] = {}
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


def _rank(c: Candidate) -> tuple:
    """Order within a kind: fitting by cost, then a memory reason before a too-small cache."""
    return (not c.fits, c.step_s, c.work_s, c.reason.startswith("a cache of"))
