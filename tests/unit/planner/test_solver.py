"""The solver against brute force, the uniform baselines and the memory limits."""

import dataclasses
import itertools

import numpy as np
import pytest

from distcache.errors import DistcacheConfigError
from distcache.planner import solver as solver_module
from distcache.planner.cost import plan_cost
from distcache.planner.solver import solve, uniform_plan
from distcache.planner.topology import preset
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    HOST_CACHED,
    ROW_WISE,
    SOLVER_SHARDINGS,
    TABLE_WISE,
    Plan,
    SolverOptions,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)
from distcache.planner.workloads import workload_preset

FRACTIONS = (0.25, 0.5)
QUICK = SolverOptions(cache_fractions=FRACTIONS, column_wise_shards=(2,), max_moves=500)


def _toy(seed: int, world: int = 2, per_node: int = 1) -> tuple[Workload, Topology]:
    """Three random tables; device memory between 30 % and 90 % of their total size."""
    rng = np.random.default_rng(seed)
    tables = tuple(
        TableStats(
            name=f"t{i}",
            rows=int(rng.integers(2000, 200_000)),
            dim=int(rng.choice([16, 32, 64])),
            pooling_factor=float(rng.choice([1, 2, 4])),
            alpha=float(rng.uniform(0.8, 1.3)),
        )
        for i in range(3)
    )
    workload = Workload(
        name=f"toy{seed}",
        tables=tables,
        batch_size_per_rank=int(rng.choice([256, 1024])),
        bottom_mlp=(64, 32, 16),
        top_mlp=(64, 1),
    )
    total = sum(t.rows * workload.row_bytes(t) for t in tables)
    topology = Topology(
        name="toy",
        world_size=world,
        ranks_per_node=per_node,
        device_memory_bytes=int(total * rng.uniform(0.3, 0.9)),
        host_memory_bytes=10**10,
        device_memory_bw_bytes_per_s=float(rng.uniform(1e10, 1e12)),
        host_to_device_bw_bytes_per_s=float(rng.uniform(1e9, 5e10)),
        intra_node_bw_bytes_per_s=1e11,
        inter_node_bw_bytes_per_s=float(rng.uniform(1e9, 5e10)),
        dense_flops_per_s=1e12,
    )
    return workload, topology


def _every_placement(table: TableStats, world: int) -> list[TablePlan]:
    layouts = [(DATA_PARALLEL, tuple(range(world))), (ROW_WISE, tuple(range(world)))]
    layouts += [(TABLE_WISE, (r,)) for r in range(world)]
    layouts += [(COLUMN_WISE, (0, 1))] if table.dim % 2 == 0 else []
    out = []
    for sharding, ranks in layouts:
        out.append(TablePlan(table=table.name, sharding=sharding, ranks=ranks))
        if sharding != DATA_PARALLEL:
            out += [
                TablePlan(
                    table=table.name,
                    sharding=sharding,
                    ranks=ranks,
                    storage=HOST_CACHED,
                    cache_fraction=f,
                    lookahead=8,
                    prefetch_depth=1,
                )
                for f in FRACTIONS
            ]
    return out


# Seeds 2 and 9 have tight memory: caches and column-wise shards are needed to fit.
@pytest.mark.parametrize("seed", [0, 2, 9])
def test_matches_brute_force_on_three_tables_and_two_ranks(seed):
    workload, topology = _toy(seed)
    best = min(
        cost.step_s
        for tables in itertools.product(
            *(_every_placement(t, topology.world_size) for t in workload.tables)
        )
        if (cost := plan_cost(Plan(name="b", tables=tables), workload, topology)).fits
    )
    # The brute force enumerates placements; replicas are a refinement after them (test_hot.py).
    placements_only = dataclasses.replace(QUICK, hot_row_shares=())
    cost = plan_cost(solve(workload, topology, options=placements_only), workload, topology)
    assert cost.fits
    assert cost.step_s == pytest.approx(best, rel=1e-9)
    with_replicas = plan_cost(solve(workload, topology, options=QUICK), workload, topology)
    assert with_replicas.step_s <= best * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_never_worse_than_a_fitting_uniform_plan(seed):
    rng = np.random.default_rng(seed)
    workload = workload_preset(f"synthetic:tables=8,rows=3e5,dim=32,seed={seed}")
    total = sum(t.rows * workload.row_bytes(t) for t in workload.tables)
    topology = Topology(
        name="two-nodes",
        world_size=4,
        ranks_per_node=2,
        device_memory_bytes=int(total * rng.uniform(0.3, 1.2)),
        host_memory_bytes=10**10,
        device_memory_bw_bytes_per_s=2e11,
        host_to_device_bw_bytes_per_s=2e10,
        intra_node_bw_bytes_per_s=1e11,
        inter_node_bw_bytes_per_s=1e10,
        dense_flops_per_s=1e13,
    )
    ours = plan_cost(solve(workload, topology, options=QUICK), workload, topology)
    assert ours.fits
    for sharding in SOLVER_SHARDINGS:
        baseline = plan_cost(uniform_plan(workload, topology, sharding), workload, topology)
        if baseline.fits:
            assert ours.step_s <= baseline.step_s * (1 + 1e-9), sharding


def _one_rank(device_bytes: int) -> Topology:
    return Topology(
        name="one",
        world_size=1,
        ranks_per_node=1,
        device_memory_bytes=device_bytes,
        host_memory_bytes=10**9,
        device_memory_bw_bytes_per_s=1e11,
        host_to_device_bw_bytes_per_s=1e10,
        intra_node_bw_bytes_per_s=1e11,
        inter_node_bw_bytes_per_s=1e10,
        dense_flops_per_s=1e12,
    )


def test_a_table_too_big_for_the_device_is_cached_and_explained():
    workload = Workload(
        name="big",
        tables=(
            TableStats(name="big", rows=400_000, dim=32),  # 51 MB
            TableStats(name="small", rows=1000, dim=32),
        ),
        batch_size_per_rank=512,
    )
    plan = solve(workload, _one_rank(35 * 10**6), options=QUICK)
    assert plan.table("big").storage == HOST_CACHED
    assert plan.table("small").storage == DEVICE
    assert plan_cost(plan, workload, _one_rank(35 * 10**6)).fits
    text = plan.explanations["big"]
    assert text.startswith("table_wise on rank 0, host + ")
    assert "rejected:" in text and "table_wise, device (does not fit" in text
    assert "data_parallel" in text
    assert set(plan.explanations) == {"big", "small"}


def test_explaining_some_tables_explains_them_as_explaining_all_does():
    """`SolverOptions.explain` names the tables explained: each one's reason is what explaining
    every table gives it (with its hot rows' note), and the plan is the same."""
    workload = workload_preset("synthetic:tables=12,rows=200000,dim=16,seed=4")
    topology = preset("h100", world_size=4)
    every = solve(workload, topology, options=QUICK)
    assert list(every.explanations) == [t.name for t in workload.tables]
    some = solve(workload, topology, options=dataclasses.replace(QUICK, explain=("t9", "t2")))
    assert some == every
    assert some.explanations == {"t2": every.explanations["t2"], "t9": every.explanations["t9"]}
    assert any("hot rows" in text for text in every.explanations.values())
    assert solve(workload, topology, options=dataclasses.replace(QUICK, explain=False)) == every


@pytest.mark.parametrize(
    ("explain", "message"),
    [(("t1", "nope"), "no table named 'nope' to explain"), ("t1", "a tuple of table names")],
)
def test_explaining_an_unknown_table_is_refused_before_solving(explain, message, monkeypatch):
    monkeypatch.setattr(solver_module, "Problem", None)  # solving would fail otherwise
    workload = workload_preset("synthetic:tables=3")
    options = dataclasses.replace(QUICK, explain=explain)
    with pytest.raises(DistcacheConfigError, match=message):
        solve(workload, _one_rank(10**9), options=options)


def test_keeps_everything_on_the_device_when_it_fits():
    workload = workload_preset("criteo-kaggle", batch_size_per_rank=256)
    topology = _one_rank(40 * 10**9)
    plan = solve(workload, topology, options=QUICK)
    assert {t.storage for t in plan.tables} == {DEVICE}


def test_no_placement_fits():
    workload = Workload(name="huge", tables=(TableStats(name="huge", rows=10**7, dim=64),))
    with pytest.raises(DistcacheConfigError, match="no placement of table 'huge'"):
        solve(workload, _one_rank(10**6), options=QUICK)


def test_a_cache_too_small_for_the_batches_in_flight_is_named_as_such():
    """A cache smaller than the rows of the K + 1 batches in flight is rejected before it is
    priced, and its reason still reaches the user (here the only cache size allowed)."""
    workload = Workload(
        name="w", tables=(TableStats(name="t", rows=100_000, dim=64),), batch_size_per_rank=512
    )
    options = dataclasses.replace(QUICK, cache_fractions=(0.001,))
    with pytest.raises(DistcacheConfigError) as refused:
        solve(workload, _one_rank(10**6), options=options)
    message = str(refused.value)
    assert "table_wise host + cache: a cache of 0.1% or less holds fewer than the" in message
    assert "rows of 2 batches in flight" in message
    assert "table_wise device: 0.0256 GB > 0.001 GB device memory" in message


def test_uniform_plans():
    workload = workload_preset("synthetic:tables=9,rows=1e5,dim=12,seed=2")
    topology = dataclasses.replace(_one_rank(10**9), world_size=4, ranks_per_node=4)
    tw = uniform_plan(workload, topology, TABLE_WISE)
    sizes = np.zeros(4)
    for t in tw.tables:
        sizes[t.ranks[0]] += workload.table(t.table).rows
    assert sizes.max() - sizes.min() <= max(t.rows for t in workload.tables)
    assert uniform_plan(workload, topology, ROW_WISE).tables[0].ranks == (0, 1, 2, 3)
    cw = uniform_plan(workload, topology, COLUMN_WISE)
    assert {len(t.ranks) for t in cw.tables} == {4}
    assert {
        len(t.ranks)
        for t in uniform_plan(workload, topology, COLUMN_WISE, column_wise_shards=3).tables
    } == {3}
    cached = uniform_plan(
        workload, topology, TABLE_WISE, storage=HOST_CACHED, cache_fraction=0.1, name="uvm"
    )
    assert cached.name == "uvm" and {t.storage for t in cached.tables} == {HOST_CACHED}
    with pytest.raises(DistcacheConfigError, match="sharding"):
        uniform_plan(workload, topology, "grid")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shardings": ("diagonal",)}, "shardings"),
        ({"storages": ()}, "storages"),
        ({"cache_fractions": (0.0,)}, "cache_fractions"),
        ({"lookaheads": (-1,)}, "lookaheads"),
        ({"column_wise_shards": (1,)}, "column_wise_shards"),
        ({"max_moves": -1}, "max_moves"),
        ({"time_limit_s": 0}, "time_limit_s"),
    ],
)
def test_options_are_validated(kwargs, message):
    with pytest.raises(DistcacheConfigError, match=message):
        SolverOptions(**kwargs)


def test_lookahead_pairs():
    options = SolverOptions(lookaheads=(0, 4), prefetch_depths=(1, 2))
    assert options.lookahead_pairs() == ((0, 0), (4, 1), (4, 2))


def test_same_inputs_give_the_same_plan_whatever_the_clock(monkeypatch):
    """The local search stops on a move budget, not on wall time: a machine 1000x slower
    (a clock that jumps 10 ms per reading) finds the plan an idle one finds."""
    workload, topology = _toy(2)  # tight memory: the local search re-places tables
    first = solve(workload, topology, options=QUICK)
    assert solve(workload, topology, options=QUICK) == first
    now = [0.0]

    def slow_clock() -> float:
        now[0] += 0.01
        return now[0]

    monkeypatch.setattr(solver_module.time, "monotonic", slow_clock)
    slow = solve(workload, topology, options=QUICK)
    assert slow == first and slow.explanations == first.explanations


def _tight() -> Topology:
    """8 ranks whose device memory binds on 40 tables: caches, and moves the search keeps."""
    return Topology(
        name="tight",
        world_size=8,
        ranks_per_node=4,
        device_memory_bytes=3 * 10**8,
        host_memory_bytes=10**11,
        device_memory_bw_bytes_per_s=2e12,
        host_to_device_bw_bytes_per_s=5e10,
        intra_node_bw_bytes_per_s=4e11,
        inter_node_bw_bytes_per_s=5e10,
        dense_flops_per_s=2e14,
    )


def test_move_budget_bounds_the_search():
    workload, topology = workload_preset("synthetic:tables=40,rows=1e6,seed=1"), _tight()
    greedy = plan_cost(
        solve(workload, topology, options=SolverOptions(max_moves=0, explain=False)),
        workload,
        topology,
    )
    searched = [
        solve(workload, topology, options=SolverOptions(max_moves=300, explain=False))
        for _ in range(2)
    ]
    assert searched[0] == searched[1]
    assert plan_cost(searched[0], workload, topology).step_s <= greedy.step_s * (1 + 1e-9)


def test_moves_priced_together_pick_as_one_at_a_time(monkeypatch):
    """The local search prices a chunk of moves at once (`search._speculate`), each against
    the state as it is: every move's picks equal those of taking its tables out and placing
    them one after the other with `evaluate` (the one-at-a-time search, written out here),
    on every start; a move not kept leaves the state bit for bit as it was; and the whole
    search ends in the same state, floats and all, with chunks of one move and of
    `MOVE_CHUNK`."""
    from distcache.planner import search
    from distcache.planner.candidates import TIE_S, Problem
    from distcache.planner.pricing import evaluate

    workload, topology = workload_preset("synthetic:tables=40,rows=1e6,seed=1"), _tight()
    options = SolverOptions(explain=False)
    problem = Problem(workload, topology, options)

    def reference(state, move: tuple[int, ...]) -> list:  # noqa: ANN001
        before, old, picks = state.flat.copy(), [state.remove(i) for i in move], []
        for k, index in enumerate(move):
            rest, floor = sum(problem.work[i] for i in move[k + 1 :]), state.score()[0]
            last = k == len(move) - 1
            enough = (lambda c, f=floor: c.step_s <= f + TIE_S) if last else None
            best = search._pick(evaluate(state, index, enough), rest, problem.world, "time")
            if best is None:
                break
            state.add(index, best.mode, best.ranks)
            picks.append((best.mode, best.ranks))
        for index in move[: len(picks)]:
            state.remove(index)
        for index, removed in zip(move, old, strict=True):
            state.add(index, *removed)
        state.flat[:] = before
        return picks

    moves = [(i,) for i in range(16)] + [(i, j) for i in range(4) for j in range(12) if i != j]
    for state in search.starts(problem, seeds=()):
        before = state.flat.copy()
        picked = search._speculate(state, moves)
        assert np.array_equal(state.flat, before)
        for move, picks in zip(moves, picked, strict=True):
            assert [(m, r) for m, r, _ in picks] == reference(state, move), move
            kept = search._try_move(state, move, picks)
            assert kept or np.array_equal(state.flat, before), move
            if kept:
                break

    ends = {}
    for chunk in (1, search.MOVE_CHUNK):
        monkeypatch.setattr(search, "MOVE_CHUNK", chunk)
        states = search.starts(problem, seeds=())
        best = search.improve(states, max_moves=300, time_limit_s=600.0)
        ends[chunk] = (best.placed, best.flat.copy())
    (placed, flat), (placed_chunked, flat_chunked) = ends.values()
    assert search.MOVE_CHUNK > 1 and placed == placed_chunked
    assert np.array_equal(flat, flat_chunked)
    assert placed != search.starts(problem, seeds=())[0].placed  # the search moved tables
