"""Hot rows measured side by side on local gloo ranks, with the model: distcache's plan, the
same without replicas, and TorchRec's plan.

`--tables` power-law tables, sequence tables of an `EmbeddingCollection` (`TableStats.pooled`
False: one output row per id on the output all-to-all) or, with `--pooled`, an
`EmbeddingBagCollection`'s (one row per bag), trained with SGD by three plans:

- `distcache`: distcache's planner's plan for the workload on the topology (the `cpu` preset,
  `--topology FILE`, or with `--calibrate` this machine as `python -m distcache calibrate`
  measures it just before, kept with the results), run as `to_sharding_plan` exports it
  (device tables on TorchRec's fused kernel, but a sequence table replicating hot rows, which
  an `EmbeddingCollection` serves on distcache's kernel, a cache of every row, loaded before
  timing) through distcache's sharder;
- `distcache without hot rows`: the same placements without replicas;
- `torchrec`: TorchRec's `EmbeddingShardingPlanner`'s plan on the same topology, on TorchRec's
  own sharder and kernel.

Each step is a forward, a loss over every output row and a backward (the row optimizer runs in
it), non-pipelined for all three; no dense layers, and the workload the model prices has none
to speak of (one input feature, MLPs of one unit). Steps run in turns, the order rotated every
step, a barrier before each; a step's time is its slowest rank's. Each of `--rounds` rounds
gives each plan a median step; the table reports the median and range over rounds, the bytes
a rank sends in one step's all-to-alls and in the replicas' all-gather (`CollectiveBytes`)
beside the cost model's, and the model's step.

    python benchmarks/hot_rows.py --calibrate --rounds 5 --steps 20 \
        --json benchmarks/results/hot_rows_sequence_cpu_2ranks.json
    python benchmarks/hot_rows.py --calibrate --pooled --tables 8 --rows 2e5 --pooling 1 \
        --batch-size 2048 --rounds 5 --steps 20 \
        --json benchmarks/results/hot_rows_pooled_dim512_cpu_2ranks.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from distcache.cache.config import CacheConfig  # noqa: E402
from distcache.job.distributed import run_ranks  # noqa: E402
from distcache.planner.cost import all_to_all_sent_bytes, plan_cost  # noqa: E402
from distcache.planner.shards import table_plan_terms  # noqa: E402
from distcache.planner.solver import solve  # noqa: E402
from distcache.planner.topology import load_topology, preset  # noqa: E402
from distcache.planner.torchrec.export import from_sharding_plan  # noqa: E402
from distcache.planner.torchrec.planner import torchrec_plan  # noqa: E402
from distcache.planner.types import Plan, TableStats, Topology, Workload  # noqa: E402

PLANS = ("distcache", "distcache without hot rows", "torchrec")


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(
        name="pooled" if args.pooled else "sequence",
        tables=tuple(
            TableStats(
                name=f"s{i}",
                rows=int(args.rows),
                dim=args.dim,
                pooling_factor=args.pooling,
                alpha=args.alpha,
                pooled=args.pooled,
            )
            for i in range(args.tables)
        ),
        batch_size_per_rank=args.batch_size,
        # No dense layers run here, so the model prices none (one input, one unit).
        dense_in_features=1,
        bottom_mlp=(1,),
        top_mlp=(1,),
    )


def plans_of(workload: Workload, topology: Topology) -> dict[str, Plan]:
    """distcache's plan, the same without replicas, and TorchRec's planner's plan."""
    ours = solve(workload, topology)
    if not any(t.hot_rows for t in ours.tables):
        raise SystemExit("distcache's plan replicates no hot rows here: nothing to compare")
    none = dataclasses.replace(
        ours, name="none", tables=tuple(dataclasses.replace(t, hot_rows=0) for t in ours.tables)
    )
    theirs = torchrec_plan(workload, topology)
    if theirs.plan is None:
        raise SystemExit(f"TorchRec's planner failed: {theirs.error}")
    world = topology.world_size
    torchrec = from_sharding_plan(theirs.plan, workload, world_size=world, name="torchrec")
    return {"distcache": ours, "distcache without hot rows": none, "torchrec": torchrec}


def _rank(rank: int, world: int, args: argparse.Namespace, plans: dict[str, Plan]) -> dict:
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from distcache.planner.torchrec.export import to_sharding_plan
    from distcache.planner.torchrec.modules import workload_ebc, workload_ec
    from distcache.sharding import (
        CachedEmbeddingBagCollectionSharder,
        CachedEmbeddingCollectionSharder,
    )
    from distcache.tools.collectives import CollectiveBytes
    from distcache.tools.measure_runs import make_whole_caches_resident

    workload = workload_of(args)
    config = CacheConfig(optimizer="sgd", learning_rate=args.lr)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    models = {}
    for name, plan in plans.items():
        torch.manual_seed(0)
        module = (workload_ebc if args.pooled else workload_ec)(workload, device="meta")
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": args.lr})
        sharding_plan = to_sharding_plan(plan, workload, world_size=world, base_config=config)
        if name == "torchrec":
            sharder = (
                EmbeddingBagCollectionSharder if args.pooled else EmbeddingCollectionSharder
            )()
        elif args.pooled:
            sharder = CachedEmbeddingBagCollectionSharder(config)
        else:
            sharder = CachedEmbeddingCollectionSharder(config)
        models[name] = DistributedModelParallel(
            module, env=env, device=torch.device("cpu"), plan=sharding_plan, sharders=[sharder]
        )
        make_whole_caches_resident(models[name])
    # Power-law ids by popularity rank (row r is the r-th likeliest, so the replicas' rows are
    # the first ones: `hottest_rows`), drawn apart on each rank.
    rng = np.random.default_rng(args.seed + rank)
    p = np.arange(1, int(args.rows) + 1, dtype=np.float64) ** -args.alpha
    cdf = np.cumsum(p / p.sum())
    features = [t.name for t in workload.tables]
    n = args.tables * args.batch_size * args.pooling
    lengths = torch.full((args.tables * args.batch_size,), args.pooling)
    batches = [
        KeyedJaggedTensor.from_lengths_sync(
            features,
            torch.from_numpy(np.searchsorted(cdf, rng.random(n)).clip(0, int(args.rows) - 1)),
            lengths,
        )
        for _ in range(16)
    ]

    def step(name: str, batch: KeyedJaggedTensor) -> None:
        out = models[name](batch)
        if args.pooled:  # a KeyedTensor of [B, sum of dims]
            out.values().sum().backward()
        else:  # {feature: JaggedTensor}, a row per id
            sum(out[f].values().sum() for f in features).backward()

    times: dict[str, list[list[float]]] = {name: [] for name in PLANS}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        per_round: dict[str, list[float]] = {name: [] for name in PLANS}
        for i in range(args.warmup if round_ == 0 else args.steps):
            batch = batches[i % len(batches)]
            for name in [*PLANS[i % 3 :], *PLANS[: i % 3]]:
                dist.barrier()
                start = time.perf_counter()
                step(name, batch)
                per_round[name].append(time.perf_counter() - start)
        if round_:
            for name in PLANS:
                times[name].append(per_round[name])
    sent = {}
    for name in PLANS:
        dist.barrier()
        with CollectiveBytes() as counted:
            step(name, batches[0])
        sent[name] = (counted.all_to_all, counted.hot_gather)
    return {"times": times, "sent": sent}


def _modelled_gather(plan: Plan, workload: Workload, topology: Topology) -> float:
    """Bytes a rank sends per step in the replicas' all-gather, as the model prices them: the
    rows its batch touches, to each other rank (the runtime sends as many as the most any rank
    touched, and a padding row)."""
    tables = {t.name: t for t in workload.tables}
    gathered = sum(
        table_plan_terms(tp, tables[tp.table], workload, topology).hot_gather_bytes
        for tp in plan.tables
    )
    return gathered * (topology.world_size - 1)


def _row(name: str, plan: Plan, ranks: list[dict], workload: Workload, topology: Topology):  # noqa: ANN202
    rounds = len(ranks[0]["times"][name])
    # per round: each step's slowest rank, then the round's median
    medians = [
        statistics.median(
            max(steps) for steps in zip(*(r["times"][name][k] for r in ranks), strict=True)
        )
        for k in range(rounds)
    ]
    sent = [sum(r["sent"][name][i] for r in ranks) / len(ranks) for i in (0, 1)]
    return {
        "plan": name,
        "placement": ", ".join(sorted({f"{t.sharding}/{t.storage}" for t in plan.tables})),
        "hot_rows": sum(t.hot_rows for t in plan.tables),
        "hot_reduce": sorted({t.hot_reduce for t in plan.tables if t.hot_rows}),
        "step_ms": 1e3 * statistics.median(medians),
        "step_ms_low": 1e3 * min(medians),
        "step_ms_high": 1e3 * max(medians),
        "round_ms": [1e3 * m for m in medians],
        "modelled_step_ms": 1e3 * plan_cost(plan, workload, topology).step_s,
        "a2a_kb": sent[0] / 1e3,
        "modelled_a2a_kb": float(all_to_all_sent_bytes(plan, workload, topology).mean()) / 1e3,
        "hot_gather_kb": sent[1] / 1e3,
        "modelled_hot_gather_kb": _modelled_gather(plan, workload, topology) / 1e3,
    }


def _ratio(rows: dict[str, dict], faster: str, slower: str) -> dict[str, object]:
    a, b = rows[faster], rows[slower]
    return {
        "measured": b["step_ms"] / a["step_ms"],
        "rounds": [y / x for x, y in zip(a["round_ms"], b["round_ms"], strict=True)],
        "modelled": float(b["modelled_step_ms"] / a["modelled_step_ms"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pooled", action="store_true", help="bags, not sequences")
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=float, default=1e5)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--pooling", type=int, default=20, help="ids a sample per table")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per rank")
    parser.add_argument("--alpha", type=float, default=1.2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topology", help="a topology JSON (`calibrate`; default: `cpu`)")
    parser.add_argument("--calibrate", action="store_true", help="calibrate this machine first")
    parser.add_argument("--json")
    args = parser.parse_args()

    workload = workload_of(args)
    calibrated = None
    if args.calibrate:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "topology.json")
            command = [sys.executable, "-m", "distcache", "calibrate", "--out", path]
            command += ["--ranks", str(args.ranks)]
            subprocess.run(command, check=True, capture_output=True)
            calibrated = json.loads(Path(path).read_text())
            topology = load_topology(path)
    elif args.topology:
        topology = load_topology(args.topology)
    else:
        topology = preset("cpu", world_size=args.ranks)
    plans = plans_of(workload, topology)
    env = {"OMP_NUM_THREADS": "1"}
    ranks = run_ranks(_rank, args.ranks, args=(args, plans), timeout_s=1800, env=env)
    rows = {name: _row(name, plans[name], ranks, workload, topology) for name in PLANS}
    summary = {
        "hot_over_none": _ratio(rows, "distcache", "distcache without hot rows"),
        "distcache_over_torchrec": _ratio(rows, "distcache", "torchrec"),
    }
    print_table(
        list(rows.values()),
        [
            ("plan", "plan"),
            ("placement", "placement"),
            ("hot_rows", "hot rows"),
            ("step_ms", "step ms"),
            ("step_ms_low", "low"),
            ("step_ms_high", "high"),
            ("modelled_step_ms", "modelled ms"),
            ("a2a_kb", "a2a KB sent"),
            ("modelled_a2a_kb", "modelled"),
            ("hot_gather_kb", "gather KB sent"),
            ("modelled_hot_gather_kb", "modelled"),
        ],
    )
    for key, value in summary.items():
        print(f"{key}: {value}")
    config = vars(args) | {"topology_name": topology.name, "calibrated_topology": calibrated}
    write_json(args.json, config, [*rows.values(), {"summary": summary}])


if __name__ == "__main__":
    main()
