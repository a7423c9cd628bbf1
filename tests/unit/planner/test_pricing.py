"""The solver's vectorized pricing against `plan_cost`."""

import pytest

from distcache.planner.candidates import Problem
from distcache.planner.cost import plan_cost
from distcache.planner.pricing import State, evaluate
from distcache.planner.types import TABLE_ROW_WISE, TABLE_WISE, SolverOptions, Topology
from distcache.planner.workloads import workload_preset

QUICK = SolverOptions(cache_fractions=(0.25, 0.5), column_wise_shards=(2,), max_moves=500)


@pytest.mark.parametrize(
    ("world", "per_node"),
    [(6, 4), (8, 4)],  # nodes of 4 and 2 ranks; two full nodes (table-row-wise is offered)
)
def test_evaluation_agrees_with_plan_cost(world, per_node):
    """The solver's vectorized pricing and its state equal `plan_cost`, on uneven nodes and
    on whole nodes, where table-row-wise candidates are priced too."""
    workload = workload_preset("synthetic:tables=5,rows=1e5,dim=32,seed=1")
    topology = Topology(
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
