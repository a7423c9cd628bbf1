"""What `python -m distcache plan` prints: the plan as a table, one line per table, then the
solver's reasons wrapped to `WIDTH` characters, under a line that says whose they are when
they are not every table's (`solver.default_explained` picks them unless --explain does).

Example::

    plan = solve(workload, topology, options=SolverOptions(explain=default_explained(workload)))
    print(format_plan(plan, workload, why=why_header(workload, plan)))
"""

from __future__ import annotations

from collections.abc import Sequence

from distcache.constants import HOT_ALL
from distcache.planner.types import Plan, TablePlan, Workload

WIDTH = 100  # characters: the plan's reasons and violations are wrapped to it


def why_header(workload: Workload, plan: Plan) -> str:
    """The line above the reasons: "why:", saying which tables' they are when not all are."""
    explained, total = len(plan.explanations), len(workload.tables)
    if explained == total:
        return "why:"
    return (
        f"why ({explained} of {total:,} tables; --explain all for every table, or "
        "--explain NAME,NAME):"
    )


def format_plan(plan: Plan, workload: Workload, why: str = "why:") -> str:
    """One line per table (placement, cache, look-ahead, hot rows; a sequence table's name
    marked '(seq)'), then the solver's reasons under the line `why`."""
    header = ["table", "rows", "dim", "sharding", "ranks", "storage", "cache", "L", "K", "hot"]
    body, by_name = [], {t.table: t for t in plan.tables}
    for table in workload.tables:
        # (A table the plan lacks: `Plan.table`'s error.)
        tp: TablePlan = by_name.get(table.name) or plan.table(table.name)
        cache = f"{100 * tp.cache_fraction:.3g}%" if tp.storage != "device" else "-"
        body.append(
            [
                table.name + ("" if table.pooled else " (seq)"),
                f"{table.rows:,}",
                str(table.dim),
                tp.sharding,
                ranks_text(tp.ranks),
                tp.storage,
                cache,
                str(tp.lookahead),
                str(tp.prefetch_depth),
                f"{tp.hot_rows:,}{' touched' * (tp.hot_reduce != HOT_ALL)}" if tp.hot_rows else "-",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    reasons = [wrap(text, f"  {name}: ", "    ") for name, text in plan.explanations.items()]
    if reasons:
        lines += ["", why, *reasons]
    return "\n".join(lines)


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as ranges: (0, 1, 2, 3, 7) -> "0-3,7"."""
    parts, ordered = [], sorted(ranks)
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ",".join(parts)


def wrap(text: str, first: str, rest: str) -> str:
    """`text` in lines of at most `WIDTH` characters (a word longer stays whole), the first
    starting with `first`, the others with `rest` (`textwrap.fill` takes 6 x as long on a
    thousand tables' reasons)."""
    lines, prefix, words, width = [], first, [], len(first)
    for word in text.split():
        if words and width + 1 + len(word) > WIDTH:
            lines.append(prefix + " ".join(words))
            prefix, words, width = rest, [word], len(rest) + len(word)
        else:
            width += len(word) + bool(words)
            words.append(word)
    lines.append(prefix + " ".join(words))
    return "\n".join(lines)
