"""The planner's cost model against measurement on this machine.

A small DLRM (4 power-law tables of 60k-500k rows, dim 16, DLRM-style MLPs, 512 samples per
rank) is trained under ten plans on 1 and 2 local gloo ranks — table-, row-, column-wise and
data-parallel mixes, caches of 100 %, 5 % and 2 % of the rows, prefetch depth K 0 and 1, and a
reactive LRU cache — each run for real (`distcache.tools.measure`: TorchRec's DMP with
distcache's sharder on the plan exported by `to_sharding_plan`, `LookaheadTrainPipeline`,
`SyntheticClickLog` batches with each table's power-law exponent). Its median step time is
compared with `plan_cost` on the topology of its world size measured by
`distcache.tools.calibrate` just before (or read from --topology FILE).

Plans with the same world size train in the same processes, in turns step by step (rotated
order, each step from a barrier), so the machine's drift touches them alike; the warm-up
fills the partial caches, device-stored tables are loaded whole before it.

The machine's 2 cores are shared with other jobs, whose load moves every rate (the same plan
measured 9.7 to 14 ms a step minutes apart, within a run +-10 %) and, with 2 ranks, how long
a collective waits for a descheduled peer (calibrated as `sync_latency_s`). So the whole
calibrate-then-measure cycle runs --repeats times and each configuration reports the run of
median error, with the range over runs. Use --threads 1 (the default); the JSON holds every
run, its topology and calibration, and the load average before and after.

Columns: the modelled step terms of the slowest rank (ms), the modelled and measured step
(ms), the model's error (modelled / measured - 1) and its range over the runs. Target
(issue 5): within +-25 % for at least six configurations. A missed target is reported, not an
error (exit status 0).

Usage::

    python benchmarks/planner.py --json benchmarks/results/planner_cpu.json
    python benchmarks/planner.py --topology t1.json --topology t2.json --repeats 1  # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402

from distcache.planner.cost import plan_cost  # noqa: E402
from distcache.planner.solver import uniform_plan  # noqa: E402
from distcache.planner.topology import load_topology  # noqa: E402
from distcache.planner.types import (  # noqa: E402
    COLUMN_WISE,
    DATA_PARALLEL,
    HOST_CACHED,
    ROW_WISE,
    TABLE_WISE,
    Plan,
    TableStats,
    Topology,
    Workload,
)
from distcache.tools.calibrate import FULL, QUICK, calibrate, topology_from  # noqa: E402
from distcache.tools.compare import TERMS  # noqa: E402
from distcache.tools.measure import MeasureOptions, measure_plans  # noqa: E402

TARGET_ERROR = 0.25  # issue 5: modelled step within +-25 % of measured ...
TARGET_CONFIGS = 6  # ... for at least six configurations


def workload(batch: int, alpha: float) -> Workload:
    """Four power-law tables of 60k-500k rows, dim 16; DLRM MLPs sized for 2 CPU cores."""
    rows = (500_000, 250_000, 120_000, 60_000)
    return Workload(
        name="planner-bench",
        tables=tuple(
            TableStats(name=f"t{i}", rows=r, dim=16, alpha=alpha) for i, r in enumerate(rows)
        ),
        batch_size_per_rank=batch,
        bottom_mlp=(256, 64, 16),
        top_mlp=(256, 64, 1),
    )


def _uniform(sharding: str, fraction: float = 1.0, lookahead: int = 8, depth: int = 1):
    """Every table placed alike; fraction < 1: host-cached with (L, K) = (lookahead, depth)."""

    def build(w: Workload, t: Topology) -> Plan:
        if fraction >= 1.0:
            return uniform_plan(w, t, sharding)
        return uniform_plan(
            w,
            t,
            sharding,
            storage=HOST_CACHED,
            cache_fraction=fraction,
            lookahead=lookahead,
            prefetch_depth=depth,
        )

    return build


def _with_data_parallel(base: Callable[[Workload, Topology], Plan], tables: int):
    """`base` with its last `tables` tables data parallel."""

    def build(w: Workload, t: Topology) -> Plan:
        plan, dp = base(w, t), uniform_plan(w, t, DATA_PARALLEL)
        keep = len(plan.tables) - tables
        return dataclasses.replace(plan, tables=(*plan.tables[:keep], *dp.tables[keep:]))

    return build


# (name, ranks, plan builder)
CONFIGS: list[tuple[str, int, Callable[[Workload, Topology], Plan]]] = [
    ("TW 100%", 1, _uniform(TABLE_WISE)),
    ("TW 5% K=1", 1, _uniform(TABLE_WISE, 0.05)),
    ("TW 2% K=0", 1, _uniform(TABLE_WISE, 0.02, depth=0)),
    ("TW 5% LRU", 1, _uniform(TABLE_WISE, 0.05, lookahead=0, depth=0)),
    ("TW 5% K=1 + 2 DP", 1, _with_data_parallel(_uniform(TABLE_WISE, 0.05), 2)),
    ("TW 100%", 2, _uniform(TABLE_WISE)),
    ("TW 2% K=1", 2, _uniform(TABLE_WISE, 0.02)),
    ("RW 5% K=1", 2, _uniform(ROW_WISE, 0.05)),
    ("CW 5% K=0", 2, _uniform(COLUMN_WISE, 0.05, depth=0)),
    ("TW 100% + 2 DP", 2, _with_data_parallel(_uniform(TABLE_WISE), 2)),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--topology",
        action="append",
        default=[],
        help="a calibrated topology JSON, used for the configs of its world size (repeatable;"
        "\ndefault: calibrate each world size now)",
    )
    ap.add_argument("--quick-calibration", action="store_true", help="calibrate at QUICK sizes")
    ap.add_argument("--batch", type=int, default=512, help="samples per rank and step")
    ap.add_argument("--alpha", type=float, default=1.05, help="power-law exponent of the ids")
    ap.add_argument("--ranks", default="1,2", help="world sizes to run (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--warmup", type=int, default=100, help="steps before timing (caches fill)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="calibrate-and-measure runs; each configuration reports its median error",
    )
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per world size")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _topology(args: argparse.Namespace, world: int) -> tuple[Topology, dict | None]:
    """The calibrated topology of `world` ranks: from a --topology file of that world size,
    else calibrated now, just before its plans run (rates measured with every rank running,
    the threads the plans train with)."""
    for path in args.topology:
        topology = load_topology(path)
        if topology.world_size == world:
            return topology, None
    sizes = QUICK if args.quick_calibration else FULL
    m = calibrate(ranks=world, sizes=sizes, threads=args.threads, timeout_s=args.timeout)
    return topology_from(m, name=f"calibrated-cpu-x{world}"), dataclasses.asdict(m)


def run_world(args: argparse.Namespace, ranks: int, repeat: int) -> tuple[list[dict], dict]:
    """Calibrate (or load) the topology of `ranks` ranks, then measure and price its configs.

    Returns:
        (one row per configuration, {"topology": ..., "calibration": ...}).
    """
    w = workload(args.batch, args.alpha)
    options = MeasureOptions(steps=args.steps, warmup=args.warmup, threads=args.threads)
    options = dataclasses.replace(options, timeout_s=args.timeout)
    topo, calibration = _topology(args, ranks)
    print(f"repeat {repeat}: topology {topo.name}: {topo.to_dict()}", flush=True)
    plans = {f"{ranks}r {name}": build(w, topo) for name, r, build in CONFIGS if r == ranks}
    measured = measure_plans(plans, w, world_size=ranks, options=options)
    rows = []
    for label, plan in plans.items():
        cost = plan_cost(plan, w, topo)
        slowest = max(cost.per_rank, key=lambda c: c.total_s)
        m = measured[label]
        rows.append(
            {
                "config": label,
                "ranks": ranks,
                "repeat": repeat,
                **{f"{t} ms": 1e3 * getattr(slowest, f) for t, f in TERMS},
                "model ms": 1e3 * cost.step_s,
                "measured ms": 1e3 * m.step_s,
                "error %": 100 * (cost.step_s / m.step_s - 1),
                "fits": cost.fits,
                "measured_cache_per_step": m.cache,
                "step_s_per_step": list(m.step_s_per_step),
                "plan": json.loads(plan.to_json()),
            }
        )
    return rows, {"topology": topo.to_dict(), "calibration": calibration}


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration, the repetition of median error, with the range over repetitions."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        runs = sorted((r for r in rows if r["config"] == config), key=lambda r: r["error %"])
        median = dict(runs[(len(runs) - 1) // 2])
        median["error range %"] = f"{runs[0]['error %']:+.0f} .. {runs[-1]['error %']:+.0f}"
        out.append(median)
    return out


def report(summary: list[dict], repeats: int) -> int:
    columns = [("config", "config")]
    columns += [(f"{t} ms", t) for t, _ in TERMS]
    columns += [("model ms", "model ms"), ("measured ms", "measured ms"), ("error %", "error %")]
    columns += [("error range %", f"range ({repeats} runs)")]
    print_table(summary, columns)
    within = [r for r in summary if abs(r["error %"]) <= 100 * TARGET_ERROR]
    outside = [r["config"] for r in summary if abs(r["error %"]) > 100 * TARGET_ERROR]
    met = "met" if len(within) >= TARGET_CONFIGS else "MISSED"
    print(
        f"target (issue 5): modelled within +-{100 * TARGET_ERROR:g} % of measured (median of "
        f"{repeats} calibrate-and-measure runs) for >= {TARGET_CONFIGS} configurations: "
        f"{len(within)} of {len(summary)} ({met})"
        + (f"; outside: {', '.join(outside)}" if outside else "")
    )
    return 0  # a missed target is a finding to report, not a failed run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    worlds = sorted({int(r) for r in args.ranks.split(",")})
    rows, topologies = [], []
    for repeat in range(args.repeats):  # each world size calibrated just before it runs
        for ranks in worlds:
            world_rows, topology = run_world(args, ranks, repeat)
            rows += world_rows
            topologies.append({"repeat": repeat, "ranks": ranks, **topology})
    summary = summarize(rows)
    status = report(summary, args.repeats)
    config = {
        **vars(args),
        "workload": dataclasses.asdict(workload(args.batch, args.alpha)),
        "topologies": topologies,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    write_json(args.json, config, [{"summary": summary, "runs": rows}])
    return status


if __name__ == "__main__":
    raise SystemExit(main())
