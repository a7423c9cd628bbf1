"""The solver's vectorized pricing against `plan_cost`."""

import math
from collections import Counter

import numpy as np
import pytest

from distcache.planner.candidates import Problem
from distcache.planner.cost import plan_cost
from distcache.planner.hot import with_hot_rows
from distcache.planner.pricing import State, cut_as_enough, evaluate, price_tables
from distcache.planner.state import shared_with_layouts, shared_with_modes
from distcache.planner.types import TABLE_ROW_WISE, TABLE_WISE, SolverOptions, Topology
from distcache.planner.workloads import workload_preset

QUICK = SolverOptions(cache_fractions=(0.25, 0.5), column_wise_shards=(2,), max_moves=500)


def _nodes(world: int, per_node: int) -> Topology:
    return Topology(
        name="nodes",
        world_size=world,
        ranks_per_node=per_node,
        device_memory_bytes=10**9,
        host_memory_bytes=10**10,
        device_memory_bw_bytes_per_s=1e11,
        host_to_device_bw_bytes_per_s=1e9,
        intra_node_bw_bytes_per_s=1e11,
        inter_node_bw_bytes_per_s=1e10,
        dense_flops_per_s=1e12,
    )


@pytest.mark.parametrize(
    ("world", "per_node"),
    [(6, 4), (8, 4)],  # nodes of 4 and 2 ranks; two full nodes (table-row-wise is offered)
)
def test_evaluation_agrees_with_plan_cost(world, per_node):
    """The solver's vectorized pricing and its state equal `plan_cost`, on uneven nodes and
    on whole nodes, where table-row-wise candidates are priced too."""
    workload = workload_preset("synthetic:tables=5,rows=1e5,dim=32,seed=1")
    topology = _nodes(world, per_node)
    problem = Problem(workload, topology, QUICK)
    state = State(problem)
    seen = set()
    for index in range(len(workload.tables)):
        for candidate in evaluate(state, index):
            seen.add(candidate.mode.placement.sharding)
            if candidate.fits:
                state.add(index, candidate.mode, candidate.ranks)
                step, work = state.score()
                assert candidate.step_s == pytest.approx(step, rel=1e-12)
                assert candidate.work_s == pytest.approx(work, rel=1e-12)
                state.remove(index)
        candidates = [c for c in evaluate(state, index) if c.fits]
        pick = candidates[(3 * index) % len(candidates)]  # a mix of layouts
        if index == 0 and TABLE_ROW_WISE in seen:
            pick = next(c for c in candidates if c.mode.placement.sharding == TABLE_ROW_WISE)
        state.add(index, pick.mode, pick.ranks)
    plan = state.plan("mix", {})
    totals = [c.total_s for c in plan_cost(plan, workload, topology).per_rank]
    assert state.totals() == pytest.approx(totals, rel=1e-12)
    assert {t.sharding for t in plan.tables} != {TABLE_WISE}
    assert (TABLE_ROW_WISE in seen) == (world % per_node == 0)


def test_tables_priced_together_equal_evaluate():
    """`price_tables` prices many tables at once, each against a plan of its own (here the
    placed plan without it); cut as `evaluate`'s `enough` would stop (`cut_as_enough`), each
    table's candidates are those `evaluate` gives, bit for bit, whether `enough` cuts the
    spread layouts or not."""
    workload = workload_preset("synthetic:tables=8,rows=1e5,dim=32,seed=3")
    problem = Problem(workload, _nodes(8, 4), QUICK)
    state = State(problem)
    for index in range(len(workload.tables)):
        fitting = [c for c in evaluate(state, index) if c.fits]
        pick = fitting[(5 * index) % len(fitting)]
        state.add(index, pick.mode, pick.ranks)
    indices = list(range(len(workload.tables)))
    flats = np.stack([state.flat - state.contrib[i].flat for i in indices])
    kinds = [state.kinds - Counter({state.contrib[i].collectives: 1}) for i in indices]
    together = price_tables(problem, indices, flats, kinds)
    cuts, placed = 0, state.flat.copy()
    for index, candidates in zip(indices, together, strict=True):
        removed = state.remove(index)
        floor = state.score()[0]
        for limit in (-math.inf, floor, math.inf):
            enough = lambda c, limit=limit: c.step_s <= limit  # noqa: E731
            alone = [_key(c) for c in evaluate(state, index, enough)]
            assert [_key(c) for c in cut_as_enough(candidates, enough)] == alone
            cuts += len(alone) < len(candidates)
        assert [_key(c) for c in evaluate(state, index)] == [_key(c) for c in candidates]
        state.add(index, *removed)
        state.flat[:] = placed  # without the rounding of the remove and add
    assert cuts  # the cut happened


def _key(c) -> tuple:  # noqa: ANN001
    return (c.mode, c.ranks, c.step_s, c.work_s, c.reason)


@pytest.mark.parametrize(("world", "per_node"), [(4, 4), (8, 4)])
def test_shared_terms_of_layouts_equal_each_mode_priced_alone_to_the_bit(world, per_node):
    """`shared_with_layouts` (the pricing batches' shared terms, many states and modes at
    once) equals `shared_with_modes` of each state alone, bit for bit, on states mixing data
    parallel, replicas reduced both ways and several kinds of collectives."""
    workload = workload_preset("synthetic:tables=6,rows=1e5,dim=32,seed=3")
    problem = Problem(workload, _nodes(world, per_node), QUICK)
    state, flats, kinds = State(problem), [], []
    for index in range(len(workload.tables)):
        candidates = [c for c in evaluate(state, index) if c.fits]
        pick = candidates[(5 * index) % len(candidates)]
        mode = pick.mode
        if index % 2 and mode.placement.sharding != "data_parallel":
            reduce = ("all", "touched")[index % 4 == 1]
            mode = with_hot_rows(state, index, mode, 50, reduce)
        state.add(index, mode, pick.ranks)
        flats.append(state.flat[state.size :].copy())
        kinds.append(Counter(state.kinds))
    layouts = [[g.modes[0] for g in problem.groups[i]] for i in range(len(workload.tables))]
    width = min(len(row) for row in layouts)
    layouts = [row[:width] for row in layouts]
    together = shared_with_layouts(problem, np.stack(flats), kinds, layouts)
    alone = [
        shared_with_modes(problem, f, k, row)
        for f, k, row in zip(flats, kinds, layouts, strict=True)
    ]
    assert together.tolist() == alone
    assert len({x for row in alone for x in row}) > 3  # the states and modes differ
