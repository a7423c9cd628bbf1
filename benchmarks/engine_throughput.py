"""Speed of the cache engine on this machine, each measurement next to its baseline.

1. Scheduler: ids/s of the look-ahead scheduler (unique, hits, victims, residency updates) on
   one large table with a small cache and big power-law batches; the reactive LRU scheduler
   side by side. No rows move (simulator over the real engine).
2. Forward + backward: steps/s of `CachedEmbeddingBags` (look-ahead window, fused SGD) at several
   capacities next to `torch.nn.EmbeddingBag` with sparse gradients + `torch.optim.SGD` on the
   same batches and sizes.

Usage::

    python benchmarks/engine_throughput.py --json benchmarks/results/engine_throughput.json
    python benchmarks/engine_throughput.py --quick      # small sizes, a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402

from distcache import CacheConfig, CachedEmbeddingBags, TableSpec  # noqa: E402
from distcache.cache.simulate import simulate  # noqa: E402
from distcache.data.traces import zipf_trace  # noqa: E402


def bench_scheduler(args) -> list[dict]:
    trace = zipf_trace(
        rows=args.sched_rows,
        alpha=args.alpha,
        batch=args.sched_batch,
        batches=args.sched_batches,
        seed=0,
    )
    batches = list(trace)
    capacity = int(args.sched_capacity * args.sched_rows)
    results = []
    for policy, victim_batches in (("lookahead", 1), ("lookahead", 4), ("lru", 1)):
        r = simulate(
            batches,
            num_rows=args.sched_rows,
            capacity=capacity,
            policy=policy,
            lookahead=8,
            prefetch_depth=1,
            victim_batches=victim_batches,
            device=args.device,
        )
        results.append(
            {
                "bench": "scheduler",
                "policy": policy,
                "victim_batches": victim_batches,
                "rows": args.sched_rows,
                "capacity": capacity,
                "batch_ids": args.sched_batch,
                "batches": len(batches),
                "loads": r.loads,
                "hit_rate": r.hits / max(1, r.hits + r.loads),
                "ids_per_s": r.ids_per_s,
                "ms_per_batch": 1e3 * r.seconds / len(batches),
            }
        )
    return results


def _batches(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = args.batch_size * args.pooling
    trace = zipf_trace(
        rows=args.rows, alpha=args.alpha, batch=n, batches=args.warmup + args.steps, seed=1
    )
    offsets = torch.arange(0, n + 1, args.pooling)
    return [(ids, offsets) for ids in trace]


def _time_steps(step, batches, warmup: int) -> float:
    for b in batches[:warmup]:
        step(b)
    start = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
    return time.perf_counter() - start


def bench_baseline(args, batches) -> dict:
    bag = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
    opt = torch.optim.SGD(bag.parameters(), lr=0.01)

    def step(batch):
        opt.zero_grad()
        bag(*batch[:1], batch[1][:-1]).sum().backward()
        opt.step()

    seconds = _time_steps(step, batches, args.warmup)
    return {
        "bench": "fwd+bwd",
        "policy": "nn.EmbeddingBag (sparse) + SGD",
        "capacity_frac": 1.0,
        "steps_per_s": args.steps / seconds,
    }


def bench_cached(args, batches, capacity: float, policy: str) -> dict:
    config = CacheConfig(
        capacity=capacity,
        lookahead=8,
        prefetch_depth=1,
        policy=policy,
        learning_rate=0.01,
        check_ids=True,
    )
    table = TableSpec(name="t", num_embeddings=args.rows, embedding_dim=args.dim)
    bags = CachedEmbeddingBags([table], config, device=args.device)
    enqueued = 0

    def step(batch):
        nonlocal enqueued
        t = step.t
        while enqueued < len(batches) and enqueued <= t + config.lookahead:
            bags.enqueue(*batches[enqueued])
            enqueued += 1
        bags.prefetch()
        out = bags(*batch)
        bags.prefetch()
        out.sum().backward()
        step.t += 1

    step.t = 0
    seconds = _time_steps(step, batches, args.warmup)
    (stats,) = bags.stats().values()
    return {
        "bench": "fwd+bwd",
        "policy": f"distcache {policy}",
        "capacity_frac": capacity,
        "capacity": stats.capacity,
        "steps_per_s": args.steps / seconds,
        "hit_rate": stats.hit_rate,
        "critical_misses": stats.critical_misses,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--sched-rows", type=int, default=40_000_000)
    ap.add_argument("--sched-capacity", type=float, default=0.02)
    ap.add_argument("--sched-batch", type=int, default=200_000)
    ap.add_argument("--sched-batches", type=int, default=40)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--pooling", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--capacities", default="1.0,0.05,0.01")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.sched_rows, args.sched_batch, args.sched_batches = 200_000, 1_000, 10
        args.rows, args.batch_size, args.warmup, args.steps = 200_000, 32, 3, 5

    sched = bench_scheduler(args)
    print("scheduler (no rows moved):")
    print_table(
        sched,
        [
            ("policy", "policy"),
            ("victim_batches", "victim batches"),
            ("rows", "rows"),
            ("capacity", "cache rows"),
            ("batch_ids", "ids/batch"),
            ("hit_rate", "hit rate"),
            ("ms_per_batch", "ms/batch"),
            ("ids_per_s", "ids/s"),
        ],
    )
    batches = _batches(args)
    fwd = [bench_baseline(args, batches)]
    for cap in (float(c) for c in args.capacities.split(",")):
        fwd.append(bench_cached(args, batches, cap, "lookahead"))
    fwd.append(bench_cached(args, batches, 0.05, "lru"))
    for r in fwd:
        r["x_baseline"] = r["steps_per_s"] / fwd[0]["steps_per_s"]
    print(
        f"\nforward+backward: {args.rows:,} rows x {args.dim}, batch {args.batch_size} bags x "
        f"{args.pooling} ids, zipf alpha {args.alpha}, {args.steps} steps after {args.warmup}"
    )
    print_table(
        fwd,
        [
            ("policy", "what"),
            ("capacity_frac", "capacity"),
            ("hit_rate", "hit rate"),
            ("critical_misses", "critical misses"),
            ("steps_per_s", "steps/s"),
            ("x_baseline", "x nn.EmbeddingBag"),
        ],
    )
    write_json(args.json, vars(args), sched + fwd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
