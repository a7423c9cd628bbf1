"""The throughput planner: access statistics, a cost model, and a solver that places each table
(data parallel, table-, row- or column-wise; on the device or in host memory behind a look-ahead
cache) to maximize modelled samples/s under the memory limits.

Example::

    from distcache.planner import plan_cost, preset, solve, workload_preset

    workload = workload_preset("criteo-terabyte")
    topology = preset("h100", world_size=8, device_memory_bytes="16GB")
    plan = solve(workload, topology)
    print(plan_cost(plan, workload, topology).samples_per_s, plan.explanations["t0"])
"""

from distcache.planner.binned import BinnedProfile, table_access
from distcache.planner.cost import plan_cost, validate_plan
from distcache.planner.shards import ShardTerms, shard_terms
from distcache.planner.solver import solve, uniform_plan
from distcache.planner.stats import AccessProfile, expected_loads, expected_unique
from distcache.planner.topology import PRESETS, load_topology, parse_bytes, preset, save_topology
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    HOST_CACHED,
    ROW_WISE,
    SHARDING_TYPES,
    SOLVER_SHARDINGS,
    STORAGES,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Placement,
    Plan,
    PlanCost,
    SolverOptions,
    StepCost,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)
from distcache.planner.workloads import WORKLOAD_PRESETS, workload_preset

__all__ = [
    "COLUMN_WISE",
    "DATA_PARALLEL",
    "DEVICE",
    "HOST_CACHED",
    "PRESETS",
    "ROW_WISE",
    "SHARDING_TYPES",
    "SOLVER_SHARDINGS",
    "TABLE_ROW_WISE",
    "STORAGES",
    "TABLE_WISE",
    "WORKLOAD_PRESETS",
    "AccessProfile",
    "BinnedProfile",
    "Placement",
    "Plan",
    "PlanCost",
    "ShardTerms",
    "SolverOptions",
    "StepCost",
    "TablePlan",
    "TableStats",
    "Topology",
    "Workload",
    "expected_loads",
    "expected_unique",
    "load_topology",
    "parse_bytes",
    "plan_cost",
    "preset",
    "save_topology",
    "shard_terms",
    "solve",
    "table_access",
    "uniform_plan",
    "validate_plan",
    "workload_preset",
]
