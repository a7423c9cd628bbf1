"""The solver's plans and their modelled cost on the presets, against a recorded golden file.

`data/solver_golden.json` holds, for every workload preset on every topology preset (plus a
calibrated CPU topology and a few `SolverOptions` variants), the plan `solve` returns (per
table: sharding, ranks, storage, cache fraction, L, K, hot rows and their reduction; and the
explanations), its `plan_cost` (per rank: every `StepCost` term, the memory and the rows its
caches load) — or the
error when no plan fits — and the `plan_cost` of the uniform baselines. A refactoring of the
planner must leave all of it equal (floats to a relative 1e-9).

Regenerate only when a change of the plans is intended, and say so in the commit:

    PYTHONPATH=. python tests/unit/planner/test_solver_golden.py --regen
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from distcache.errors import DistcacheConfigError
from distcache.planner.cost import plan_cost
from distcache.planner.solver import solve, uniform_plan
from distcache.planner.topology import preset
from distcache.planner.types import (
    HOST_CACHED,
    SOLVER_SHARDINGS,
    Plan,
    SolverOptions,
    Topology,
    Workload,
)
from distcache.planner.workloads import workload_preset

GOLDEN = Path(__file__).parent / "data" / "solver_golden.json"
REL = 1e-9

# A CPU topology as `python -m distcache calibrate` measured it on 2 ranks
# (benchmarks/results/planner_cpu.json): every CPU-only term of the cost model is set.
CALIBRATED_CPU = Topology(
    name="calibrated-cpu-x2",
    world_size=2,
    ranks_per_node=2,
    compute_device="cpu",
    device_memory_bytes=11369994240,
    host_memory_bytes=11369994240,
    device_memory_bw_bytes_per_s=7360198429.419051,
    host_to_device_bw_bytes_per_s=41345859.5001918,
    host_to_device_latency_s=2.3220004550239537e-06,
    intra_node_bw_bytes_per_s=646415304.8831851,
    inter_node_bw_bytes_per_s=646415304.8831851,
    network_latency_s=0.00036915008235418744,
    dense_flops_per_s=88422247274.0305,
    lookup_rows_per_s=4428404.441814804,
    lookup_bytes_per_s=23558019846.978138,
    cache_scan_rows_per_s=11450903.704374697,
    dense_update_bytes_per_s=888125016.9298043,
    dense_activation_bytes_per_s=3446011926.7284317,
    dense_layer_overhead_s=0.00011082849994181743,
    step_overhead_s=0.006879398585192451,
    sharding_overhead_s=0.0020901680008454824,
    id_overhead_s=2.318254762778395e-06,
    sync_latency_s=0.0010264815064147115,
)

# name: (topology preset, world size, device memory per rank); tight memory makes caches pay.
TOPOLOGIES = {
    "h100": ("h100", 8, "4GB"),
    "h200": ("h200", 16, "8GB"),
    "cpu": ("cpu", 2, None),
}
WORKLOADS = ("criteo-kaggle", "criteo-terabyte", "synthetic")
LIGHT = {"cache_fractions": (0.01, 0.1), "max_moves": 200}
# (case name, workload spec, topology name, SolverOptions keyword arguments)
VARIANTS = (
    ("calibrated-cpu/criteo-kaggle", "criteo-kaggle", "calibrated-cpu", {}),
    ("calibrated-cpu/synthetic-small", "synthetic:tables=12,rows=2e5,seed=4", "calibrated-cpu", {}),
    ("h100/criteo-terabyte/greedy", "criteo-terabyte", "h100", {"max_moves": 0}),
    (
        "h100/criteo-kaggle/lru-and-depths",
        "criteo-kaggle",
        "h100",
        {**LIGHT, "lookaheads": (0, 16), "prefetch_depths": (0, 1, 2)},
    ),
    (
        "h200/synthetic/row-column",
        "synthetic:tables=40,rows=3e6,seed=2,pooling=2",
        "h200",
        {**LIGHT, "shardings": ("row_wise", "column_wise"), "column_wise_shards": (2, 4, 8)},
    ),
    (
        "h100x64/synthetic-large/no-explain",
        "synthetic:tables=60,rows=1e7,seed=5",
        "h100x64",
        {**LIGHT, "explain": False},
    ),
)
UNIFORM = (("h100", "criteo-terabyte"), ("cpu", "criteo-kaggle"), ("calibrated-cpu", "synthetic"))


def _topology(name: str) -> Topology:
    if name == "calibrated-cpu":
        return CALIBRATED_CPU
    if name == "h100x64":
        return preset("h100", world_size=64, device_memory_bytes="2GB")
    kind, world, memory = TOPOLOGIES[name]
    return preset(kind, world_size=world, device_memory_bytes=memory)


def _cost_record(plan: Plan, workload: Workload, topology: Topology) -> dict[str, Any]:
    cost = plan_cost(plan, workload, topology)
    return {
        "step_s": cost.step_s,
        "fits": cost.fits,
        "violations": list(cost.violations),
        "per_rank": [dataclasses.asdict(c) for c in cost.per_rank],
        "device_memory_bytes": list(cost.device_memory_bytes),
        "host_memory_bytes": list(cost.host_memory_bytes),
        "loads_per_step": list(cost.loads_per_step),
    }


def _plan_record(plan: Plan, workload: Workload, topology: Topology) -> dict[str, Any]:
    return {
        "name": plan.name,
        # table, sharding, ranks, storage, cache fraction, L, K, hot rows, their reduction
        "tables": [
            [
                t.table,
                t.sharding,
                list(t.ranks),
                t.storage,
                t.cache_fraction,
                t.lookahead,
                t.prefetch_depth,
                t.hot_rows,
                t.hot_reduce,
            ]
            for t in plan.tables
        ],
        "explanations": plan.explanations,
        "cost": _cost_record(plan, workload, topology),
    }


def _solve_record(spec: str, topology_name: str, options: dict[str, Any]) -> dict[str, Any]:
    workload, topology = workload_preset(spec), _topology(topology_name)
    try:
        plan = solve(workload, topology, options=SolverOptions(**options))
    except DistcacheConfigError as error:
        return {"error": str(error)}
    return _plan_record(plan, workload, topology)


def _uniform_record(topology_name: str, spec: str) -> dict[str, Any]:
    workload, topology = workload_preset(spec), _topology(topology_name)
    out = {}
    for sharding in SOLVER_SHARDINGS:
        plan = uniform_plan(workload, topology, sharding, column_wise_shards=4)
        out[sharding] = _plan_record(plan, workload, topology)
    cached = uniform_plan(
        workload,
        topology,
        "table_wise",
        storage=HOST_CACHED,
        cache_fraction=0.05,
        lookahead=64,
        prefetch_depth=1,
    )
    out["table_wise-host_cached"] = _plan_record(cached, workload, topology)
    return out


def _cases() -> dict[str, tuple]:
    cases: dict[str, tuple] = {}
    for topology_name in TOPOLOGIES:
        for spec in WORKLOADS:
            cases[f"{topology_name}/{spec}"] = (_solve_record, spec, topology_name, {})
    for name, spec, topology_name, options in VARIANTS:
        cases[name] = (_solve_record, spec, topology_name, options)
    for topology_name, spec in UNIFORM:
        cases[f"uniform/{topology_name}/{spec}"] = (_uniform_record, topology_name, spec)
    return cases


def _record(name: str) -> dict[str, Any]:
    function, *args = _cases()[name]
    # Through JSON, so tuples and lists compare alike.
    return json.loads(json.dumps(function(*args)))


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, int | float) and isinstance(want, int | float), where
        assert math.isclose(got, want, rel_tol=REL, abs_tol=0.0), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(_cases()))
def test_same_plans_and_costs_as_recorded(name, golden):
    assert name in golden, f"{name} is not recorded; regenerate (see the module docstring)"
    _assert_same(_record(name), golden[name], name)


def test_every_recorded_case_is_checked(golden):
    assert sorted(golden) == sorted(_cases())


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        sys.exit(f"usage: {sys.argv[0]} --regen")
    GOLDEN.parent.mkdir(exist_ok=True)
    records = {name: _record(name) for name in sorted(_cases())}
    GOLDEN.write_text(json.dumps(records, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {len(records)} cases to {GOLDEN}")
