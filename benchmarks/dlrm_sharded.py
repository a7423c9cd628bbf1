"""DLRM on 2 gloo ranks (CPU): distcache's sharder at a small cache vs TorchRec's default sharder.

Both models are torchrec.models.dlrm.DLRM with 26 tables of Criteo-Kaggle-like sizes (scaled by
--scale so they fit here), table-wise sharded, fused SGD on the embeddings, measured side by
side in one run on the same batches (power-law ids, one per feature per sample, like Criteo).
The variants take turns step by step, each step timed from a barrier, so the machine's drift
touches them alike; the slowest rank sets the figure:

- torchrec: TorchRec's EmbeddingBagCollectionSharder, every row in memory (fused kernel);
- distcache sync: distcache's kernel at --capacity, rows staged when a batch is looked up;
- distcache prefetch: the same, each next batch routed and staged through TorchRec's prefetch
  hook while the current one trains (K=1; routes each batch twice: once ahead, once in forward);
- distcache pipeline: LookaheadTrainPipeline, each batch routed once as it enters a window of
  L=2 batches, rows staged K=1 ahead, trained from its routed input.

Tables whose --capacity cache could not hold the batches in flight are cached whole (a planner
keeps such small tables on the device). Prints steps/s and per-table hits, loads, write-backs.

Usage::

    python benchmarks/dlrm_sharded.py --json benchmarks/results/dlrm_sharded.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402


def _rows(scale: float) -> list[int]:
    from distcache.planner.workloads import CRITEO_KAGGLE_ROWS

    return [max(3, int(r * scale)) for r in CRITEO_KAGGLE_ROWS]


def _batches(rank: int, args, rows: list[int]):
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    from distcache.data.traces import zipf_trace

    n = args.warmup + args.steps
    per_table = [
        zipf_trace(
            rows=r, alpha=args.alpha, batch=args.batch, batches=n, seed=1000 * rank + t
        ).ids.view(n, args.batch)
        for t, r in enumerate(rows)
    ]
    gen = torch.Generator().manual_seed(rank)
    keys = [f"f{t}" for t in range(len(rows))]
    lengths = torch.ones(len(rows) * args.batch, dtype=torch.int64)
    out = []
    for step in range(n):
        values = torch.cat([ids[step] for ids in per_table])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        out.append(
            Batch(
                dense_features=torch.randn(args.batch, 13, generator=gen),
                sparse_features=kjt,
                labels=(torch.rand(args.batch, generator=gen) < 0.25).float(),
            )
        )
    return out


def _run(rank: int, world: int, port: int, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from distcache import CacheConfig
    from distcache.job.dlrm import (
        DLRMConfig,
        apply_embedding_optimizer,
        build_dlrm,
        cached_sharder,
        dense_optimizer,
        shard_dlrm,
    )
    from distcache.pipeline import LookaheadTrainPipeline
    from distcache.sharding import cache_stats

    rows = _rows(args.scale)
    batches = _batches(rank, args, rows)
    variants = {}
    names = ("torchrec", "distcache sync", "distcache prefetch", "distcache pipeline")
    for variant in names:
        model = build_dlrm(DLRMConfig(rows=rows, dim=args.dim), seed=0)
        apply_embedding_optimizer(model, "sgd", lr=0.05)
        sharder = None  # TorchRec's, every row in memory (fused kernel)
        if variant != "torchrec":
            # Tables whose cache could not hold the K + 1 = 2 batches in flight: cached whole.
            config = CacheConfig(capacity=args.capacity, lookahead=1, prefetch_depth=1)
            sharder = cached_sharder(rows, config, world_size=world, batch_size=args.batch)
        dmp = shard_dlrm(model, sharder, device=torch.device("cpu"))
        dense = dense_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=0.05))
        sharded = next(m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection))
        pipeline = None
        if variant == "distcache pipeline":
            pipeline = LookaheadTrainPipeline(dmp, dense, torch.device("cpu"))
        variants[variant] = (dmp, dense, sharded, variant == "distcache prefetch", pipeline)

    def stage(sharded, kjt) -> None:
        ctx = sharded.create_context()
        sharded.prefetch(dist_input=sharded.input_dist(ctx, kjt).wait().wait(), ctx=ctx)

    seconds = dict.fromkeys(variants, 0.0)
    losses: dict[str, list[float]] = {v: [] for v in variants}
    for _, _, sharded, prefetch, _ in variants.values():
        if prefetch:
            stage(sharded, batches[0].sparse_features)
    feeds = {v: iter(batches) for v in variants}
    # Variants take turns step by step, so the machine's drift touches them alike.
    for step, batch in enumerate(batches):
        for variant, (dmp, dense, sharded, prefetch, pipeline) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            if pipeline is not None:
                loss = pipeline.progress(feeds[variant])[0]
            else:
                loss, _ = dmp(batch)
                if prefetch and step + 1 < len(batches):
                    stage(sharded, batches[step + 1].sparse_features)
                dense.zero_grad()
                loss.backward()
                dense.step()
            losses[variant].append(loss.item())
            if step >= args.warmup:
                seconds[variant] += time.perf_counter() - start
    results = []
    for variant, (dmp, *_) in variants.items():
        row = {
            "variant": variant,
            "steps_per_s": args.steps / seconds[variant],
            "samples_per_s": args.steps * args.batch * world / seconds[variant],
            "final_loss": sum(losses[variant][-5:]) / 5,
        }
        if variant != "torchrec":
            row["tables"] = {k.split("/")[-1]: s.as_dict() for k, s in cache_stats(dmp).items()}
        results.append(row)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.02, help="table rows = Kaggle rows x scale")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=512, help="samples per rank")
    ap.add_argument("--capacity", type=float, default=0.05)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_run, args=(args.world_size, port, args, out), nprocs=args.world_size)
        per_rank = [
            json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world_size)
        ]
    rows = _rows(args.scale)
    print(
        f"DLRM, {len(rows)} tables ({sum(rows):,} rows x {args.dim}, Kaggle sizes x "
        f"{args.scale}), {args.world_size} ranks x {args.batch} samples, cache "
        f"{100 * args.capacity:.0f} %"
    )
    summary = []
    for i, row in enumerate(per_rank[0]):
        steps = min(r[i]["steps_per_s"] for r in per_rank)  # the slowest rank sets the pace
        summary.append(
            {
                "variant": row["variant"],
                "steps_per_s": steps,
                "samples_per_s": steps * args.batch * args.world_size,
                "x_torchrec": steps / min(r[0]["steps_per_s"] for r in per_rank),
                "final_loss": sum(r[i]["final_loss"] for r in per_rank) / len(per_rank),
            }
        )
    print_table(
        summary,
        [
            ("variant", "variant"),
            ("steps_per_s", "steps/s"),
            ("samples_per_s", "samples/s"),
            ("x_torchrec", "x torchrec"),
            ("final_loss", "loss (last 5)"),
        ],
    )
    tables = []
    for rank, results in enumerate(per_rank):
        for name, s in results[3].get("tables", {}).items():
            tables.append(
                {
                    "rank": rank,
                    "cache": name,
                    "capacity": s["capacity"],
                    "rows": s["num_rows"],
                    "hit_rate": s["hit_rate"],
                    "loads": s["loads"],
                    "writebacks": s["writebacks"],
                    "critical": s["critical_misses"],
                }
            )
    print("\ndistcache pipeline, per cache (tables of one width share one):")
    print_table(
        tables,
        [
            ("rank", "rank"),
            ("cache", "tables"),
            ("rows", "rows"),
            ("capacity", "cached rows"),
            ("hit_rate", "hit rate"),
            ("loads", "loads"),
            ("writebacks", "write-backs"),
            ("critical", "critical misses"),
        ],
    )
    write_json(args.json, vars(args), [{"summary": summary, "per_rank": per_rank}])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
