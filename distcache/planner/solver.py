"""The throughput solver: per table a placement, storage, cache size and look-ahead, balanced
over ranks, minimizing the modelled step time (the slowest rank's) under the memory limits.

Every cost comes from `cost.py`, on the per-rank terms `plan_cost` uses; a state is judged
by (step, work), work being the rank time summed over ranks (see `state.State`). The stages
live in their own files: the menu (step 1) in `candidates.py`, a partial plan in `state.py`,
the pricing of a table's modes against it in `pricing.py`, the greedy passes and local search
(steps 2-4) in `search.py`, the hot rows (step 5) in `hot.py`, the explanations (step 6) in
`explain.py`; this file holds the entry point (its options, `SolverOptions`, are in `types.py`).

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
5. Hot rows (`hot.py`): each sharded table of the best plan tries replicating its likeliest
   rows on every rank (`SolverOptions.hot_row_shares`), kept where the step drops.
6. Explanations (of the tables `SolverOptions.explain` names; by default all): per table,
   the chosen placement and the best placement of every other kind with the step the plan
   would have, or why it does not fit; and the replica sizes tried.

On 3 tables and 2 ranks the result equals a brute-force search over every placement
(tests/unit/planner/test_solver.py).

Example::

    plan = solve(workload_preset("criteo-terabyte"), preset("h100", world_size=8))
    print(plan.explanations["t0"])
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator

from distcache.errors import DistcacheConfigError
from distcache.planner.candidates import Problem
from distcache.planner.explain import explain
from distcache.planner.hot import choose_hot_rows
from distcache.planner.search import improve, starts
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    ROW_WISE,
    SOLVER_SHARDINGS,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Plan,
    SolverOptions,
    TablePlan,
    Topology,
    Workload,
)

log = logging.getLogger(__name__)


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
    explained = explained_tables(workload, options.explain)  # (a name it lacks: refused at once)
    problem = Problem(workload, topology, options)
    log.debug("solve: menus of %d tables in %.2f s", len(problem.tables), time.monotonic() - began)
    states = starts(problem, seeds=_baselines(workload, topology, options))
    log.debug("solve: %d starts by %.2f s", len(states), time.monotonic() - began)
    best = improve(states, max_moves=options.max_moves, time_limit_s=options.time_limit_s)
    log.debug("solve: improved by %.2f s, step %.4g s", time.monotonic() - began, best.score()[0])
    hot = choose_hot_rows(best, options.hot_row_shares, noted=frozenset(explained))
    log.debug("solve: hot rows by %.2f s, step %.4g s", time.monotonic() - began, best.score()[0])
    explanations = explain(best, explained)
    for index, note in hot.items():
        name = problem.tables[index].name
        if name in explanations:
            explanations[name] += f"; {note}"
    log.debug("solve: explained by %.2f s", time.monotonic() - began)
    return best.plan(f"distcache-{workload.name}-{topology.name}", explanations)


EXPLAINED = 32  # tables explained unless told (`default_explained`)


def default_explained(workload: Workload) -> bool | tuple[str, ...]:
    """`SolverOptions.explain` for `plan` without --explain: True (every table) for at most
    `EXPLAINED` tables, else the names of the `EXPLAINED` largest (rows times row bytes; the
    first of equal ones), in the workload's order: a thousand tables' reasons run to
    megabytes, and cost a tenth of the plan's time."""
    tables = workload.tables
    if len(tables) <= EXPLAINED:
        return True
    size = [-t.rows * workload.row_bytes(t) for t in tables]
    largest = sorted(range(len(tables)), key=size.__getitem__)[:EXPLAINED]
    return tuple(tables[i].name for i in sorted(largest))


def explained_tables(workload: Workload, explain: bool | tuple[str, ...]) -> list[int]:
    """The indices of the tables `SolverOptions.explain` names (True: every table).

    Raises:
        DistcacheConfigError: a name of no table of `workload`, or not a tuple of names."""
    if explain is True:
        return list(range(len(workload.tables)))
    if not isinstance(explain, bool | tuple) or not all(isinstance(n, str) for n in explain or ()):
        raise DistcacheConfigError(
            f"SolverOptions.explain must be True, False or a tuple of table names, got {explain!r}"
        )
    index = {t.name: i for i, t in enumerate(workload.tables)}
    names = () if explain is False else explain
    unknown = [name for name in names if name not in index]
    if unknown:
        some = ", ".join(list(index)[:5]) + (", ..." if len(index) > 5 else "")
        raise DistcacheConfigError(
            f"no table named {', '.join(map(repr, unknown))} to explain (the workload's "
            f"tables: {some})"
        )
    return sorted({index[name] for name in names})


def _baselines(workload: Workload, topology: Topology, options: SolverOptions) -> Iterator[Plan]:
    """The uniform device baselines the options allow: seeds of the search, so that the
    result is never worse than a fitting baseline."""
    for sharding in (TABLE_WISE, ROW_WISE, COLUMN_WISE, DATA_PARALLEL):
        if sharding in options.shardings and DEVICE in options.storages:
            shards = max(options.column_wise_shards, default=None)
            yield uniform_plan(workload, topology, sharding, column_wise_shards=shards)


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
    Table-row-wise: largest tables first, each on the node with the fewest bytes so far.

    Args:
        workload: the tables.
        topology: the ranks.
        sharding: one of `types.SOLVER_SHARDINGS`.
        storage, cache_fraction, lookahead, prefetch_depth: as in `TablePlan`, for every table.
        name: the plan's name (default "all-<sharding>[-<storage>]").
        column_wise_shards: at most this many shards per column-wise table.

    Example::

        baseline = uniform_plan(workload, topology, TABLE_WISE)
    """
    if sharding not in SOLVER_SHARDINGS:
        raise DistcacheConfigError(f"sharding {sharding!r} is not one of {SOLVER_SHARDINGS}")
    world = topology.world_size
    everyone = tuple(range(world))
    assigned = [(0.0, rank) for rank in everyone]  # a heap of (bytes so far, rank)
    per_node = topology.ranks_per_node
    nodes = [(0.0, n) for n in range(topology.num_nodes)]  # a heap of (bytes so far, node)
    tables = sorted(workload.tables, key=lambda t: -t.rows * workload.row_bytes(t))
    plans = {}
    for table in tables:
        size = table.rows * workload.row_bytes(table) * (1 if storage == DEVICE else cache_fraction)
        if sharding in (DATA_PARALLEL, ROW_WISE):
            ranks = everyone
        elif sharding == TABLE_ROW_WISE:
            used, node = heapq.heappop(nodes)
            heapq.heappush(nodes, (used + size, node))
            ranks = tuple(range(node * per_node, min((node + 1) * per_node, world)))
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
