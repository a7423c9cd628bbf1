"""The framework's fixed costs, fitted from tiny plans trained for real (for `calibrate`).

What a training step costs beyond the priced work (a step's fixed overhead, a sharding type's,
an id's, and the bytes/s of a data-parallel table's dense update) cannot be derived from the
calibrated rates; `measure_framework_costs` times four tiny plans that differ in one thing
each (`distcache.tools.measure.time_plans_here`) and subtracts what the cost model prices: on
CPU (the rank's gloo group) or on one GPU (a one-rank NCCL group; TorchRec's DMP on CUDA needs
FBGEMM's CUDA build), where it is the launches and host work of a step that the device waits
for.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from distcache.planner.cost import plan_cost
from distcache.planner.types import (
    DATA_PARALLEL,
    ROW_WISE,
    TABLE_WISE,
    Plan,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)
from distcache.tools.measure import MeasureOptions, time_plans_here


@dataclass(frozen=True, kw_only=True)
class FrameworkCosts:
    """What a training step costs beyond the priced work (`Topology` fields)."""

    step_overhead_s: float
    sharding_overhead_s: float
    id_overhead_s: float
    hot_bag_overhead_s: float
    dense_update_bytes_per_s: float | None
    """None when the big table's update was lost in the noise (the model's default stands)."""


ROUNDS = 3  # the first plan's runs at either batch, in turns (`measure_framework_costs`)
HOT_ROWS = 64  # t1's rows replicated in the hot-row run (about 40 % of its lookups)


def measure_framework_costs(
    topology: Topology,
    *,
    big_rows: int = 250_000,
    big_batch: int = 8192,
    options: MeasureOptions | None = None,
    device: str = "cpu",
    data_parallel: bool = True,
) -> FrameworkCosts:
    """Time tiny plans on this rank and fit the costs the cost model cannot derive.

    The model is a DLRM too small to compute much (MLPs of one layer and two, tables `t0` of
    1000 rows and `t1` of `big_rows`, dim 16). At batch 8, four plans differ in one thing
    each: (t0, t1) table-wise / table-wise, table-wise / row-wise (a second sharding type),
    data parallel / table-wise (a second type, data parallel), table-wise / data parallel
    (the big table's dense update); the first plan runs again at `big_batch` (more ids).
    With `topology`'s other rates (its framework costs ignored) each run's priced time is
    subtracted from its measured median step:

    - dense update: table bytes per second from the last two plans' difference;
    - sharding overhead: the mean of what a second sharding type adds (row-wise, data parallel);
    - step overhead: what remains of the first plan once its one sharding type is paid;
    - id overhead: what the bigger batch adds, per id routed (sent and served); the two runs
      of the first plan are repeated in turns (`ROUNDS`), their medians kept;
    - hot-row overhead: at `big_batch`, the first plan with `HOT_ROWS` of t1's rows
      replicated (`sharding.hot_rows`), step by step beside it: what it costs beyond its
      priced terms, per bag of t1 (one id each).

    Args:
        topology: the calibrated rates (lookups, dense compute); its world size is ignored.
        big_rows: rows of `t1`: its dense update should take far longer than a step's noise.
        big_batch: the batch of the second run of the first plan: large, so that the
            per-id cost is a large difference (thousands of ids).
        options: steps and warm-up.
        device: "cpu" or "cuda" (this process's GPU; each step timed between two
            `torch.cuda.synchronize`).
        data_parallel: False: without the data-parallel plans (TorchRec's kernel missing):
            no dense update (None), the sharding overhead from the row-wise plan alone.

    Runs in this process, whose default process group must be of one rank (TorchRec's plans
    name global ranks; NCCL on CUDA).
    """
    workload, plans = _framework_plans(big_rows, data_parallel)
    bigger = dataclasses.replace(workload, batch_size_per_rank=big_batch)
    measured = {
        n: statistics.median(s)
        for n, s in time_plans_here(plans, workload, options=options, device=device).items()
    }
    t0, t1 = plans["tw"].tables
    hot = dataclasses.replace(
        plans["tw"], name="tw+hot", tables=(t0, dataclasses.replace(t1, hot_rows=HOT_ROWS))
    )
    small_s, big_s, hot_s = _in_turns(
        plans["tw"], hot, workload, bigger, measured["tw"], options, device
    )
    extra_bytes = (big_rows - 1000) * workload.row_bytes(workload.tables[0])
    update_s = measured["tw+dp"] - measured["dp+tw"] if data_parallel else 0.0
    update_rate = extra_bytes / update_s if update_s > 0 else None  # (None: not measured)
    free = dataclasses.replace(  # the framework's costs left out of the price
        topology, world_size=1, ranks_per_node=1, step_overhead_s=0.0,
        sharding_overhead_s=0.0, id_overhead_s=0.0, hot_bag_overhead_s=0.0,
        dense_update_bytes_per_s=update_rate,
    )  # fmt: skip
    excess = {n: measured[n] - plan_cost(p, workload, free).step_s for n, p in plans.items()}
    big_excess = big_s - plan_cost(plans["tw"], bigger, free).step_s
    hot_excess = hot_s - plan_cost(hot, bigger, free).step_s
    small_excess = small_s - plan_cost(plans["tw"], workload, free).step_s
    routed = 2 * 2 * (big_batch - workload.batch_size_per_rank)  # 2 tables, sent and served
    second = [excess[n] for n in ("tw+rw", "dp+tw") if n in excess]  # a second type's
    sharding = max(0.0, sum(second) / len(second) - excess["tw"])
    return FrameworkCosts(
        step_overhead_s=max(0.0, excess["tw"] - sharding),
        sharding_overhead_s=sharding,
        id_overhead_s=max(0.0, (big_excess - small_excess) / routed),
        hot_bag_overhead_s=max(0.0, (hot_excess - big_excess) / big_batch),
        dense_update_bytes_per_s=update_rate,
    )


def _in_turns(
    tw: Plan,
    hot: Plan,
    workload: Workload,
    bigger: Workload,
    first: float,
    options: MeasureOptions | None,
    device: str,
) -> tuple[float, float, float]:
    """Median steps of `tw` at either batch and of `hot` at the bigger one. The per-id costs
    are small differences of steps: the pairs are timed in turns, `ROUNDS` times, and each
    one's median kept (one slow moment of this machine moved them 10 x); `first`: a run of
    `tw` at the small batch already made."""
    pair = {"tw": tw, "tw+hot": hot}
    small_runs, big_runs, hot_runs = [first], [], []
    for i in range(ROUNDS):
        both = time_plans_here(pair, bigger, options=options, device=device)
        big_runs.append(statistics.median(both["tw"]))
        hot_runs.append(statistics.median(both["tw+hot"]))
        if i + 1 < ROUNDS:
            small = time_plans_here({"tw": tw}, workload, options=options, device=device)["tw"]
            small_runs.append(statistics.median(small))
    return tuple(statistics.median(r) for r in (small_runs, big_runs, hot_runs))


def _framework_plans(big_rows: int, data_parallel: bool) -> tuple[Workload, dict[str, Plan]]:
    """`measure_framework_costs`'s tiny DLRM at batch 8 and its four plans of (t0, t1) (two
    without the data-parallel ones)."""
    workload = Workload(
        name="calibration",
        tables=(
            TableStats(name="t0", rows=1000, dim=16),
            TableStats(name="t1", rows=big_rows, dim=16),
        ),
        batch_size_per_rank=8,
        dense_in_features=4,
        bottom_mlp=(16,),
        top_mlp=(4, 1),
    )
    layouts = {
        "tw": (TABLE_WISE, TABLE_WISE),
        "tw+rw": (TABLE_WISE, ROW_WISE),
        "dp+tw": (DATA_PARALLEL, TABLE_WISE),
        "tw+dp": (TABLE_WISE, DATA_PARALLEL),
    }
    if not data_parallel:
        layouts = {n: kinds for n, kinds in layouts.items() if DATA_PARALLEL not in kinds}
    plans = {
        name: Plan(
            name=name,
            tables=tuple(
                TablePlan(table=t, sharding=k, ranks=(0,))
                for t, k in zip(("t0", "t1"), kinds, strict=True)
            ),
        )
        for name, kinds in layouts.items()
    }
    return workload, plans
