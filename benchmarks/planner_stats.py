"""Calibrate the planner's access-statistics model against the trace simulator.

For zipf traces, compares the model's expected unique rows per batch and steady-state loads
per batch (LRU: Che's approximation; look-ahead and LFU: the frequency model) with the
simulator's, and prints the model's error.

Usage::

    python benchmarks/planner_stats.py --json benchmarks/results/planner_stats.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402

from distcache.cache.simulate import simulate  # noqa: E402
from distcache.data.traces import zipf_trace  # noqa: E402
from distcache.planner import AccessProfile, expected_loads, expected_unique  # noqa: E402

CASES = [(100_000, 1.05, 1024), (1_000_000, 0.9, 8192), (1_000_000, 1.2, 4096)]
POLICIES = [("lru", "lru"), ("lfu", "frequency"), ("lookahead", "frequency")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100, help="batches excluded (cache filling)")
    ap.add_argument("--capacities", default="0.02,0.05,0.1", help="fractions of the table rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows_out = []
    for rows, alpha, batch in CASES:
        trace = list(zipf_trace(rows=rows, alpha=alpha, batch=batch, batches=args.batches))
        profile = AccessProfile.power_law(rows, alpha)
        unique_model = expected_unique(profile, batch)
        unique_measured = float(np.mean([b.unique().numel() for b in trace]))
        rows_out.append(
            {
                "trace": f"zipf({rows:.0e}, {alpha}, batch {batch})",
                "what": "unique rows/batch",
                "measured": unique_measured,
                "model": unique_model,
                "error_pct": 100 * (unique_model - unique_measured) / unique_measured,
            }
        )
        for frac in (float(c) for c in args.capacities.split(",")):
            capacity = int(frac * rows)
            for policy, model in POLICIES:
                kw = {"num_rows": rows, "capacity": capacity, "policy": policy}
                full = simulate(trace, **kw)
                head = simulate(trace[: args.warmup], **kw)
                measured = (full.loads - head.loads) / (len(trace) - args.warmup)
                predicted = expected_loads(profile, batch, capacity, model)
                rows_out.append(
                    {
                        "trace": f"zipf({rows:.0e}, {alpha}, batch {batch})",
                        "what": f"loads/batch {policy} at {frac:.0%}",
                        "measured": measured,
                        "model": predicted,
                        "error_pct": 100 * (predicted - measured) / measured,
                    }
                )
    print_table(
        rows_out,
        [
            ("trace", "trace"),
            ("what", "quantity"),
            ("measured", "simulator"),
            ("model", "model"),
            ("error_pct", "error %"),
        ],
    )
    write_json(args.json, vars(args), rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
