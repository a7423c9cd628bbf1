"""The planner's cost model against a GPU measurement: `gpu_headline.py`'s results.

For each measured variant of a headline JSON (one GPU; all rows on the device, and distcache's
look-ahead and LRU caches at their capacities), the planner prices the same workload (the
headline's tables, dim, batch, power law and dense MLPs) on a topology (a preset, or a
`distcache calibrate` JSON of that machine) and compares:
- the step: modelled (dense + lookup + exposed staging) against measured (ms per step);
- rows loaded per step: the planner's `expected_loads` with one cache per table (each 2 % of
  its own rows, as the planner plans caches), and with one cache shared by the tables (the C
  likeliest rows of all tables resident: what distcache's engine does for tables of one width
  and dtype, as in the headline), against the loads the run counted.

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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402
from gpu_headline import BOTTOM, DENSE_FEATURES, TOP  # noqa: E402

from distcache.planner.cost import plan_cost  # noqa: E402
from distcache.planner.solver import uniform_plan  # noqa: E402
from distcache.planner.stats import expected_loads  # noqa: E402
from distcache.planner.topology import PRESETS, load_topology, preset  # noqa: E402
from distcache.planner.types import HOST_CACHED, TABLE_WISE, TableStats, Workload  # noqa: E402


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


def loads_per_table_caches(workload: Workload, fraction: float, model: str) -> float:
    """Rows loaded per step with one cache of `fraction` of its rows per table."""
    n = workload.batch_size_per_rank  # one id per feature per sample
    return sum(
        expected_loads(t.profile(), n, max(1, int(fraction * t.rows)), model)
        for t in workload.tables
    )


def loads_shared_cache(workload: Workload, fraction: float) -> float:
    """Rows loaded per step with one cache of `fraction` of all rows shared by the tables,
    'frequency' model: the likeliest rows of all tables resident, every other touched row
    loaded."""
    n = workload.batch_size_per_rank
    touch = np.concatenate(
        [-np.expm1(n * np.log1p(-t.profile().probabilities)) for t in workload.tables]
    )
    capacity = int(fraction * touch.size)
    if capacity >= touch.size:
        return 0.0
    resident = np.partition(touch, touch.size - capacity)[touch.size - capacity :]
    return float(touch.sum() - resident.sum())


def compare(results: dict, topology) -> list[dict]:
    workload = workload_of(results["config"])
    config = results["config"]
    rows = []
    for r in results["results"]:
        if "step_ms" not in r or r["variant"] == "cpu_embeddings":
            continue
        cached = r.get("capacity") is not None
        if cached:
            lookahead = r["variant"] != "lru"
            plan = uniform_plan(
                workload, topology, TABLE_WISE, storage=HOST_CACHED,
                cache_fraction=r["capacity"],
                lookahead=config["lookahead"] if lookahead else 0,
                prefetch_depth=config["prefetch_depth"] if lookahead else 0,
            )  # fmt: skip
        else:
            plan = uniform_plan(workload, topology, TABLE_WISE)
        (step,) = plan_cost(plan, workload, topology).per_rank
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
        if cached:
            model = "frequency" if r["variant"] != "lru" else "lru"
            row["measured_loads"] = r.get("loads_per_step")
            row["loads_per_table_caches"] = loads_per_table_caches(workload, r["capacity"], model)
            if model == "frequency":
                row["loads_shared_cache"] = loads_shared_cache(workload, r["capacity"])
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
        ("measured_loads", "loads measured"), ("loads_per_table_caches", "model, cache per table"),
        ("loads_shared_cache", "model, shared cache"),
    ])  # fmt: skip
    config = {"results": args.results, "topology": topology.to_dict()}
    write_json(args.json, config, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
