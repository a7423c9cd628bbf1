"""The planner's cost model against a GPU measurement: `gpu_headline.py`'s results.

For each measured variant of a headline JSON (one GPU; all rows on the device, distcache's
look-ahead and LRU caches and FBGEMM's LRU caches, priced as reactive ones, at their
capacities), the planner prices the same workload (the headline's tables, dim, batch, power
law and dense MLPs) on a topology (a preset, or a `distcache calibrate` JSON of that machine)
and compares:
- the step: modelled (dense + lookup + exposed staging) against measured (ms per step);
- rows loaded per step: the planner's own figure (`PlanCost.loads_per_step`: one cache shared
  by the tables of one width and dtype, as distcache's engine runs them and the headline's
  tables are, `planner/caches.py`), and one cache per table, each its fraction of its own rows
  (`table_plan_terms`, as the solver prices caches), against the loads the run counted.

It reads results; it runs nothing on a GPU.

Usage::

    python benchmarks/planner_vs_gpu.py \\
        benchmarks/results/h200/8_headline_terabyte_2pct_full_run1.json \\
        --json benchmarks/results/h200/planner_vs_headline.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402
from gpu_headline import BOTTOM, DENSE_FEATURES, TOP  # noqa: E402

from distcache.planner.cost import plan_cost  # noqa: E402
from distcache.planner.shards import table_plan_terms  # noqa: E402
from distcache.planner.solver import uniform_plan  # noqa: E402
from distcache.planner.topology import PRESETS, load_topology, preset  # noqa: E402
from distcache.planner.types import (  # noqa: E402
    HOST_CACHED,
    TABLE_WISE,
    Plan,
    TableStats,
    Topology,
    Workload,
)


def workload_of(config: dict) -> Workload:
    """The headline's workload as the planner sees it."""
    dim = config["dim"]
    tables = tuple(
        TableStats(name=f"t{i}", rows=r, dim=dim, alpha=config["alpha"])
        for i, r in enumerate(config["rows"])
    )
    return Workload(
        name=f"headline-{config['tables']}/{config['scale']:g}",
        tables=tables,
        batch_size_per_rank=config["batch"],
        dense_in_features=DENSE_FEATURES,
        bottom_mlp=(*BOTTOM, dim),
        top_mlp=(*TOP, 1),
    )


def per_table_loads(plan: Plan, workload: Workload, topology: Topology) -> float:
    """Rows loaded per step by `plan`'s host-cached tables (one rank, one id per feature per
    sample) with one cache per table, as the solver prices them (`table_plan_terms`)."""
    tables = {t.name: t for t in workload.tables}
    terms = [table_plan_terms(tp, tables[tp.table], workload, topology) for tp in plan.tables]
    return sum(t.loads_per_step for t in terms)


def compare(results: dict, topology: Topology) -> list[dict]:
    workload = workload_of(results["config"])
    config = results["config"]
    rows = []
    for r in results["results"]:
        if "step_ms" not in r or r["variant"] == "cpu_embeddings":
            continue
        cached = r.get("capacity") is not None
        if cached:  # the reactive caches (LRU; FBGEMM's) see no batch ahead
            lookahead = r["variant"] not in ("lru", "fbgemm_uvm", "fbgemm_uvm_prefetch")
            plan = uniform_plan(
                workload, topology, TABLE_WISE, storage=HOST_CACHED,
                cache_fraction=r["capacity"],
                lookahead=config["lookahead"] if lookahead else 0,
                prefetch_depth=config["prefetch_depth"] if lookahead else 0,
            )  # fmt: skip
        else:
            plan = uniform_plan(workload, topology, TABLE_WISE)
        cost = plan_cost(plan, workload, topology)
        (step,) = cost.per_rank
        modelled = step.dense_compute_s + step.lookup_s + step.exposed_staging_s
        row = {
            "variant": r["variant"],
            "capacity": r.get("capacity"),
            "measured_ms": r["step_ms"],
            "modelled_ms": 1e3 * modelled,
            "modelled_dense_ms": 1e3 * step.dense_compute_s,
            "modelled_lookup_ms": 1e3 * step.lookup_s,
            "modelled_exposed_staging_ms": 1e3 * step.exposed_staging_s,
        }
        if cached:  # ('lru' for the reactive variants)
            row["measured_loads"] = r.get("loads_per_step")
            row["loads_shared_cache"] = cost.loads_per_step[0]
            row["loads_per_table_caches"] = per_table_loads(plan, workload, topology)
        rows.append(row)
    device = {r["variant"]: r for r in rows}.get("device")
    for row in rows:
        if device:
            row["measured_x_device"] = device["measured_ms"] / row["measured_ms"]
            row["modelled_x_device"] = device["modelled_ms"] / row["modelled_ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", help="a gpu_headline.py JSON")
    ap.add_argument("--topology", default="h200", help=f"a preset {PRESETS} or a JSON file")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    if args.topology in PRESETS:
        topology = preset(args.topology, world_size=1)
    else:
        topology = load_topology(args.topology)
    rows = compare(results, topology)
    print(
        f"{args.results}: measured on {results['machine'].get('gpu')}, modelled on {topology.name}"
    )
    print_table(rows, [
        ("variant", "variant"), ("capacity", "capacity"), ("measured_ms", "measured ms"),
        ("modelled_ms", "modelled ms"), ("measured_x_device", "measured x device"),
        ("modelled_x_device", "modelled x device"),
        ("modelled_exposed_staging_ms", "model staging ms"),
        ("measured_loads", "loads measured"), ("loads_shared_cache", "model (shared cache)"),
        ("loads_per_table_caches", "model, cache per table"),
    ])  # fmt: skip
    config = {"results": args.results, "topology": topology.to_dict()}
    write_json(args.json, config, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
