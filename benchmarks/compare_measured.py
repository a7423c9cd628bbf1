"""Plans measured side by side on this machine: `compare --measure`, repeated, with the model.

Calibrates this machine once (`python -m distcache calibrate`), then runs `python -m distcache
compare --measure` `--runs` times on local gloo ranks: distcache's plan, the same placements
without hot rows (when the plan has some), TorchRec's plan on TorchRec's own kernels (and
through distcache's sharder and pipeline), all table-wise and all row-wise, interleaved step by
step within a run.
Writes every run's rows and the median and range of each ratio (`compare.speedups`): distcache
over TorchRec by distcache's model, by TorchRec's estimator and measured, and what the hot rows
buy, modelled and measured.

    python benchmarks/compare_measured.py \
        --workload "synthetic:tables=8,rows=1e6,dim=16,mlp=32,alpha=1.2,pooling=4" \
        --runs 3 --json benchmarks/results/compare_fused_cpu_2ranks.json

`--plan FILE` (repeatable) measures saved plans beside them; with two, the runs also give the
first's speed over the second's (`first_over_second`: the second's step time / the first's):

    python benchmarks/compare_measured.py \
        --workload "synthetic:tables=8,rows=1e6,dim=16,mlp=32,alpha=1.2,pooling=4" \
        --plan benchmarks/plans/hot_rows_75.json --plan benchmarks/plans/no_hot_rows.json \
        --runs 3 --json benchmarks/results/hot_rows_fused_cpu_2ranks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402


def _distcache(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "distcache", *args], capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        raise SystemExit(f"distcache {args[0]} failed:\n{run.stderr[-2000:]}")
    return run.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, help="a workload preset")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, help="samples per rank (compare's default)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per plan and run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plan", action="append", default=[], help="a saved plan (repeatable)")
    args = parser.parse_args()
    plans = [a for path in args.plan for a in ("--plan", str(Path(path).resolve()))]
    batch = ["--batch-size", str(args.batch_size)] if args.batch_size else []
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        topology = str(Path(tmp) / "topology.json")
        _distcache("calibrate", "--out", topology)
        calibrated = json.loads(Path(topology).read_text())  # kept with the results
        for _ in range(args.runs):
            out = _distcache(
                "compare", "--preset", args.workload, "--topology", topology,
                "--world-size", str(args.world_size), "--measure",
                "--measure-steps", str(args.steps), "--json", *plans, *batch,
            )  # fmt: skip
            runs.append(json.loads(out))
    ratios = {}
    for key in runs[0]["distcache_over_torchrec"]:
        values = [r["distcache_over_torchrec"][key] for r in runs]
        if all(v is not None for v in values):
            ratios[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "runs": values,
            }
    if len(args.plan) == 2:
        names = [json.loads(Path(p).read_text())["name"] for p in args.plan]
        values = []
        for r in runs:
            step = {x["name"]: x.get("measured_step_ms") for x in r["rows"]}
            values.append(step[names[1]] / step[names[0]])
        ratios["first_over_second"] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "runs": values,
            "plans": names,
        }
    table = []
    for name in [row["name"] for row in runs[0]["rows"]]:
        rows = [next(x for x in r["rows"] if x["name"] == name) for r in runs]
        measured = [x["measured_step_ms"] for x in rows if x.get("measured_step_ms")]
        table.append(
            {
                "plan": name,
                "modelled_ms": rows[0]["step_ms"],
                "measured_ms": statistics.median(measured) if measured else None,
                "a2a_kb_measured": rows[0].get("measured_all_to_all_kb_per_rank"),
                "a2a_kb_modelled": rows[0].get("modelled_all_to_all_kb_per_rank"),
            }
        )
    print_table(
        table,
        [
            ("plan", "plan"),
            ("modelled_ms", "modelled ms"),
            ("measured_ms", "measured ms (median)"),
            ("a2a_kb_measured", "a2a KB measured"),
            ("a2a_kb_modelled", "a2a KB modelled"),
        ],
    )
    for key, r in ratios.items():
        print(f"{key}: {r['median']:.2f} x ({r['min']:.2f}-{r['max']:.2f})")
    config = vars(args) | {
        "machine_calibrated": "python -m distcache calibrate, just before",
        "calibrated_topology": calibrated,
    }
    write_json(args.json, config, [{"summary": table, "ratios": ratios, "runs": runs}])


if __name__ == "__main__":
    main()
