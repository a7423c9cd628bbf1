"""The planner's rows loaded per step against the engine's own count, on the GPU headline's
tables at full size, replayed on CPU (issue 35, item 1: rows loaded within 15 %).

Which rows a cache loads follows from the ids: the scheduler runs the same ops on every device
and reads nothing back (on a GPU its CUDA graphs pad a batch to a graph's size, which moves its
victims' sweep a little: the H200's counts were replayed here within 0.02 %). `--replay` shows
it for a `gpu_headline.py` result: that run's own batches (its `Data`: the same seeds and sizes),
replayed here through one `CacheEngine` over every table's rows as `CachedEmbeddingBags` runs
them (zero-width rows: `cache.simulate`'s replay), counted over the run's timed steps, beside
the loads the GPU counted.

The main run replays `gpu_headline.py`'s kind of batches (one power-law id per feature and
sample, Criteo Terabyte's or Kaggle's tables) for --steps steps, drawn --chunk steps at a time,
and counts the loads of each --window steps, for the look-ahead policy (distcache's default)
and LRU (distcache's reactive cache, and the planner's model of TorchRec's
`fused_uvm_caching`). Beside them, what the planner prices for the same workload: one cache
shared by the tables (`plan_cost`, 'frequency' with a look-ahead, 'lru' without). The model
prices a long run; a look-ahead cache learns which rows to keep as their uses accumulate, so
its loads fall for thousands of steps after it fills (LRU's settle within one window).

Usage::

    python benchmarks/planner_loads.py --tables terabyte --capacities 0.02 --steps 16000
    python benchmarks/planner_loads.py --replay \\
        benchmarks/results/h200_2026-11-27/1_headline_terabyte_2pct.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402
from gpu_headline import TABLE_ROWS  # noqa: E402
from planner_vs_gpu import workload_of  # noqa: E402

from distcache.cache.config import CacheConfig  # noqa: E402
from distcache.cache.engine import CacheEngine  # noqa: E402
from distcache.cache.simulate import Feed  # noqa: E402
from distcache.data.traces import zipf_trace  # noqa: E402
from distcache.planner.cost import plan_cost  # noqa: E402
from distcache.planner.solver import uniform_plan  # noqa: E402
from distcache.planner.topology import preset  # noqa: E402
from distcache.planner.types import HOST_CACHED, TABLE_WISE  # noqa: E402

POLICIES = ("lookahead", "lru")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tables", choices=sorted(TABLE_ROWS), default="terabyte")
    ap.add_argument("--scale", type=float, default=1.0, help="rows divided by this")
    ap.add_argument("--batch", type=int, default=4096, help="samples a step (one id a table)")
    ap.add_argument("--alpha", type=float, default=1.05, help="power-law exponent of the ids")
    ap.add_argument("--lookahead", type=int, default=64)
    ap.add_argument("--prefetch-depth", type=int, default=1)
    ap.add_argument("--capacities", default="0.02", help="cache fractions, comma-separated")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"of {POLICIES}")
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--window", type=int, default=1000, help="steps per count")
    ap.add_argument("--chunk", type=int, default=256, help="steps of ids drawn at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", default=None, help="a gpu_headline.py JSON to replay instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.capacities = [float(c) for c in args.capacities.split(",")]
    args.policies = args.policies.split(",")
    bad = sorted(set(args.policies) - set(POLICIES))
    if bad or not 0 < min(args.capacities) <= max(args.capacities) < 1 or args.window < 1:
        ap.error(
            f"--policies {bad} not in {POLICIES}, or --capacities outside (0, 1), or --window < 1"
        )
    return args


def headline_rows(tables: str, scale: float) -> list[int]:
    """The table sizes `gpu_headline.py --tables --scale` trains."""
    return [max(3, round(r / scale)) for r in TABLE_ROWS[tables]]


class Replay:
    """One engine over the rows of every table (table t's rows after table t - 1's), fed as
    `CachedEmbeddingBags` feeds it (`simulate.Feed`): batch t + L enqueued, the oldest staged
    (K ahead), looked up and released; `batch(s)` gives batch s's ids, in order."""

    def __init__(
        self,
        rows: list[int],
        fraction: float,
        policy: str,
        lookahead: int,
        depth: int,
        batch: Callable[[int], torch.Tensor],
    ):
        lookahead = lookahead if policy == "lookahead" else 0
        config = CacheConfig(
            capacity=sum(math.ceil(fraction * r) for r in rows),
            lookahead=lookahead,
            prefetch_depth=depth if lookahead else 0,
            policy=policy,
        )
        self.engine = CacheEngine(num_rows=sum(rows), dim=0, config=config, name="replay")
        self.step = Feed(self.engine, batch, lookahead).step  # (train step t)

    @property
    def loads(self) -> int:
        return self.engine.stats().loads


def chunked_batches(rows: list[int], args: argparse.Namespace) -> Callable[[int], torch.Tensor]:
    """Batch t's ids `[tables · batch]`, engine rows, drawn `--chunk` steps at a time (chunk k
    of table i from seed `seed + i + 1000·k`), two chunks kept."""
    base = torch.tensor([0, *rows[:-1]]).cumsum(0).view(-1, 1)  # [tables, 1]
    kept: dict[int, torch.Tensor] = {}

    def batch(t: int) -> torch.Tensor:
        k = t // args.chunk
        if k not in kept:
            kept.pop(k - 2, None)
            per_table = [
                zipf_trace(
                    rows=r, alpha=args.alpha, batch=args.batch, batches=args.chunk,
                    seed=args.seed + i + 1000 * k,
                ).ids.view(args.chunk, args.batch)
                for i, r in enumerate(rows)
            ]  # fmt: skip
            kept[k] = torch.stack(per_table, dim=1) + base  # [chunk, tables, batch]
        return kept[k][t % args.chunk].reshape(-1)

    return batch


def modelled_loads(config: dict, fraction: float, policy: str) -> float:
    """Rows the planner prices loaded per step: the tables' one shared cache on one rank."""
    workload = workload_of(config)
    topology = preset("h200", world_size=1)  # (loads depend on the workload alone)
    ahead = policy == "lookahead"
    plan = uniform_plan(
        workload, topology, TABLE_WISE, storage=HOST_CACHED, cache_fraction=fraction,
        lookahead=config["lookahead"] if ahead else 0,
        prefetch_depth=config["prefetch_depth"] if ahead else 0,
    )  # fmt: skip
    return plan_cost(plan, workload, topology).loads_per_step[0]


def windows(replay: Replay, steps: int, window: int) -> Iterator[tuple[int, float, float]]:
    """(first step, loads per step, seconds) of each `window` steps."""
    before, start = replay.loads, time.perf_counter()
    for t in range(steps):
        replay.step(t)
        if (t + 1) % window == 0:
            yield t + 1 - window, (replay.loads - before) / window, time.perf_counter() - start
            before, start = replay.loads, time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        return replay_headline(args)
    rows = headline_rows(args.tables, args.scale)
    config = _config(args, rows)
    out = []
    for fraction in args.capacities:
        for policy in args.policies:
            model = modelled_loads(config, fraction, policy)
            batch = chunked_batches(rows, args)
            replay = Replay(rows, fraction, policy, args.lookahead, args.prefetch_depth, batch)
            for first, loads, seconds in windows(replay, args.steps, args.window):
                row = {"capacity": fraction, "policy": policy, "steps_from": first}
                row |= {
                    "engine_loads": loads,
                    "model_loads": model,
                    "engine_x_model": loads / model,
                }
                out.append(row)
                print(f"  {policy} {fraction:g} from step {first}: {loads:,.0f} ({seconds:.0f} s)")
    print(f"{args.tables} tables / {args.scale:g}: {sum(rows):,} rows, batches of {args.batch}")
    print_table(out, [
        ("capacity", "capacity"), ("policy", "policy"), ("steps_from", "steps from"),
        ("engine_loads", "engine loads/step"), ("model_loads", "model loads/step"),
        ("engine_x_model", "engine / model"),
    ])  # fmt: skip
    write_json(args.json, config, out)
    return 0


def _config(args: argparse.Namespace, rows: list[int]) -> dict:
    config = {k: v for k, v in vars(args).items() if k not in ("json", "replay")}
    return config | {"rows": rows, "dim": 64, "total_rows": sum(rows)}


def replay_headline(args: argparse.Namespace) -> int:
    """`--replay`: a `gpu_headline.py` run's distcache loads per timed step, counted again
    here on that run's own batches."""
    run = json.loads(Path(args.replay).read_text())
    c = run["config"]
    rows = c["rows"]
    n = c["max_warmup"] + c["warmup"] + c["steps"] + c["profile_steps"] + c["lookahead"] + 1
    per_table = [
        zipf_trace(
            rows=r, alpha=c["alpha"], batch=c["batch"], batches=n, seed=c["seed"] + i
        ).ids.view(n, c["batch"])
        for i, r in enumerate(rows)
    ]  # as gpu_headline.Data draws them
    ids = torch.stack(per_table, dim=1) + torch.tensor([0, *rows[:-1]]).cumsum(0).view(-1, 1)
    out = []
    for r in run["results"]:
        if r["variant"] != "distcache" or r.get("loads_per_step") is None:
            continue
        first = r["fill_steps"] + c["warmup"]
        replay = Replay(
            rows, r["capacity"], "lookahead", c["lookahead"], c["prefetch_depth"],
            lambda s: ids[s].reshape(-1),
        )  # fmt: skip
        for t in range(first):
            replay.step(t)
        before = replay.loads
        for t in range(first, first + c["steps"]):
            replay.step(t)
        counted = (replay.loads - before) / c["steps"]
        measured = r["loads_per_step"]
        row = {"capacity": r["capacity"], "steps_from": first, "measured_loads": measured}
        out.append(row | {"replayed_loads": counted, "replayed_x_measured": counted / measured})
    where = run["machine"].get("gpu") or run["machine"].get("processor")
    print(f"{args.replay}: measured on {where}, replayed here")
    print_table(out, [
        ("capacity", "capacity"), ("steps_from", "timed from step"),
        ("measured_loads", "measured loads/step"), ("replayed_loads", "replayed loads/step"),
        ("replayed_x_measured", "replayed / measured"),
    ])  # fmt: skip
    write_json(args.json, {"replay": args.replay, "headline_config": c}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
