"""Replay a trace through the cache policies and Belady's optimum, side by side.

Counts rows loaded, dirty rows written back and critical-path misses per policy and capacity,
and the scheduler's replay speed (ids/s). No rows are moved: the simulator drives the real
engine with zero-width rows. With --steady-after W only the batches from W on are counted
(the steady state, once the caches are full); on a zipf trace --model adds the planner's
figures for the same cache (`planner.binned`: 'frequency', the likeliest rows resident, which
the planner prices look-ahead caches with, and 'lru', Che's approximation).

Usage::

    python benchmarks/cache_policies.py --trace zipf:rows=1e6,alpha=1.05,batch=16384,batches=200 \
        --capacity 0.01,0.02,0.05 --lookahead 8 --prefetch-depth 1 --json out.json
    python benchmarks/cache_policies.py --trace movielens --batch 512 --capacity 0.02,0.05,0.1
    python benchmarks/cache_policies.py --trace my_trace.npz --capacity 5000
    python benchmarks/cache_policies.py --trace movielens --batch 64 --capacity 0.2,0.3 \
        --policies optimal,lookahead --lookahead 8,16,32,64,128,256   # an L sweep
    python benchmarks/cache_policies.py --lookahead 64 --capacity 1000000 --model \
        --trace zipf:rows=2e7,alpha=1.05,batch=20000,batches=2000 --steady-after 1500
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402

from distcache.cache.simulate import SIM_POLICIES, simulate  # noqa: E402
from distcache.data.traces import TraceUnavailable, parse_trace_spec  # noqa: E402
from distcache.errors import CacheCapacityError  # noqa: E402
from distcache.planner.binned import BinnedProfile  # noqa: E402


def parse_capacities(text: str, distinct: int) -> list[int]:
    """'0.01,0.05' are fractions of the trace's distinct rows; '5000' is a row count."""
    out = []
    for part in text.split(","):
        value = float(part)
        if value <= 0:
            raise SystemExit(f"--capacity {part}: expected a fraction in (0, 1] or rows >= 1")
        out.append(max(1, round(value * distinct)) if value <= 1 and "." in part else int(value))
    return out


def _modelled(
    name: str, capacity: int, distinct: int, optimum: int | None, batches: int, args
) -> list[dict]:
    """The planner's loads for a cache of `capacity` rows on the zipf trace `name` (its
    'frequency' and 'lru' models, per batch in steady state), as rows of the table."""
    if not name.startswith("zipf:"):
        raise SystemExit(f"--model: the planner's figures need a zipf trace, not {name!r}")
    params = dict(part.split("=") for part in name.split(":", 1)[1].split(","))
    profile = BinnedProfile.power_law(int(float(params["rows"])), float(params["alpha"]))
    counted = batches - args.steady_after
    out = []
    for model in ("frequency", "lru"):
        per_batch = profile.loads(float(params["batch"]), capacity, model)
        out.append({
            "policy": f"model: {model}", "capacity": capacity,
            "capacity_frac": capacity / distinct, "loads": round(per_batch * counted),
            "loads_per_batch": per_batch,
            "x_optimal": per_batch * counted / optimum if optimum else None,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", default="zipf:rows=1e6,alpha=1.05,batch=16384,batches=200,seed=0")
    ap.add_argument("--batch", type=int, default=None, help="events per batch (--trace movielens)")
    ap.add_argument("--capacity", default="0.01,0.02,0.05")
    ap.add_argument(
        "--lookahead",
        default="8",
        help="L for 'lookahead'; a list (8,64,256) runs one look-ahead row per L",
    )
    ap.add_argument(
        "--prefetch-depth",
        default="1",
        help="K for 'lookahead'; a list (0,1) runs one look-ahead row per K. K=0 has the same "
        "capacity semantics as the optimum (only the batch looked up is pinned)",
    )
    ap.add_argument("--policies", default="optimal,lookahead,lru,lfu")
    ap.add_argument(
        "--steady-after",
        type=int,
        default=0,
        help="count the batches from this one on (after a warm-up that fills the caches)",
    )
    ap.add_argument(
        "--model", action="store_true", help="add the planner's loads (zipf traces only)"
    )
    ap.add_argument("--json", default=None, help="write results and config here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    policies = args.policies.split(",")
    for p in policies:
        if p not in SIM_POLICIES:
            raise SystemExit(f"--policies: unknown {p!r}; expected some of {SIM_POLICIES}")
    try:
        trace = parse_trace_spec(args.trace, batch=args.batch)
    except TraceUnavailable as err:
        print(f"skipped: trace {args.trace!r} is unavailable here: {err}")
        return 0
    distinct = trace.num_unique()
    batches = list(trace)
    capacities = parse_capacities(args.capacity, distinct)
    print(
        f"trace {trace.name}: {trace.num_batches} batches, {trace.ids.numel():,} ids, "
        f"{distinct:,} distinct of {trace.num_rows:,} rows"
    )

    depths = [int(k) for k in args.prefetch_depth.split(",")]
    lookaheads = [int(la) for la in args.lookahead.split(",")]
    runs = [
        (p, la, k)
        for p in policies
        for la in (lookaheads if p == "lookahead" else [lookaheads[0]])
        for k in (depths if p == "lookahead" else [0])
    ]
    results = []
    for capacity in capacities:
        optimum = None
        for policy, lookahead, depth in runs:
            label = f"{policy} L={lookahead} K={depth}" if policy == "lookahead" else policy
            row = {"policy": label, "capacity": capacity, "capacity_frac": capacity / distinct}
            try:
                r = simulate(
                    batches,
                    num_rows=trace.num_rows,
                    capacity=capacity,
                    policy=policy,
                    lookahead=lookahead,
                    prefetch_depth=depth,
                    count_from=args.steady_after,
                )
            except CacheCapacityError as err:
                row["error"] = str(err).split(":", 1)[1].strip()[:60]
                results.append(row)
                continue
            row.update(r.as_dict())
            row["policy"] = label
            row["ms_per_batch"] = 1e3 * r.seconds / max(1, r.batches)
            row["loads_per_batch"] = r.loads / max(1, r.batches)
            if policy == "optimal":
                optimum = r.loads
            row["x_optimal"] = r.loads / optimum if optimum else None
            results.append(row)
        if args.model:
            results += _modelled(trace.name, capacity, distinct, optimum, len(batches), args)

    print_table(
        results,
        [
            ("policy", "policy"),
            ("capacity", "capacity"),
            ("capacity_frac", "of distinct"),
            ("loads", "loads"),
            ("loads_per_batch", "loads/batch"),
            ("x_optimal", "x optimum"),
            ("writebacks", "write-backs"),
            ("critical_misses", "critical misses"),
            ("ids_per_s", "ids/s"),
            ("ms_per_batch", "ms/batch"),
            ("error", "error"),
        ],
    )
    config = {
        **vars(args),
        "trace_name": trace.name,
        "distinct_rows": distinct,
        "num_rows": trace.num_rows,
        "batches": trace.num_batches,
    }
    write_json(args.json, config, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
