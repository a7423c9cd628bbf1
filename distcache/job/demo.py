"""`python -m distcache demo`: the cache at work on a small synthetic job, in seconds.

Trains a tiny click model whose embedding tables live in host memory behind 2 % caches filled by
the look-ahead scheduler, then shows (1) the loss falling and what the caches did, (2) that the
trained tables equal the same training without any cache, and (3) how the look-ahead policy
compares with LRU, LFU and Belady's optimum on the job's own id trace.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from distcache.arguments import positive_int
from distcache.cache.config import CacheConfig
from distcache.cache.module import CachedEmbeddingBags, TableSpec
from distcache.cache.simulate import simulate
from distcache.data.traces import zipf_trace

log = logging.getLogger("distcache.job.demo")

POOLING = 4  # ids per bag
TABLES = (
    TableSpec(name="user", num_embeddings=500_000, embedding_dim=16),
    TableSpec(name="item", num_embeddings=200_000, embedding_dim=16),
    TableSpec(name="category", num_embeddings=200_000, embedding_dim=8, pooling="mean"),
)
#: One training batch: table-major ids [tables * batch * POOLING], offsets [tables * batch + 1],
#: labels [batch].
_Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _batches(
    tables: Sequence[TableSpec], *, batch_size: int, pooling: int, steps: int, seed: int
) -> list[_Batch]:
    """Table-major power-law batches and labels that depend on the ids (so there is signal)."""
    per_table = [
        zipf_trace(
            rows=t.num_embeddings,
            alpha=1.05,
            batch=batch_size * pooling,
            batches=steps,
            seed=seed + i,
        )
        for i, t in enumerate(tables)
    ]
    gen = torch.Generator().manual_seed(seed)
    truth = [torch.randn(t.num_embeddings, generator=gen) for t in tables]
    offsets = torch.arange(0, len(tables) * batch_size * pooling + 1, pooling)
    out = []
    for step in range(steps):
        ids = [trace.batch(step) for trace in per_table]
        score = sum(w[i].view(batch_size, pooling).mean(1) for w, i in zip(truth, ids, strict=True))
        out.append((torch.cat(ids), offsets, (score > 0).float()))
    return out


@dataclass
class _Model:
    """Embedding bags under a linear click head, with the head's optimizer."""

    bags: CachedEmbeddingBags | list[nn.EmbeddingBag]
    head: nn.Linear
    optimizer: torch.optim.Optimizer


def _models(config: CacheConfig, seed: int) -> tuple[_Model, _Model]:
    """The cached model and a reference without a cache, starting from the same weights."""
    bags = CachedEmbeddingBags(list(TABLES), config, seed=seed)
    reference = [
        nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, sparse=True)
        for t in TABLES
    ]
    for t, ref in zip(TABLES, reference, strict=True):
        ref.weight.data.copy_(bags.table_weight(t.name))
    head = nn.Linear(sum(t.embedding_dim for t in TABLES), 1)
    ref_head = nn.Linear(head.in_features, 1)
    ref_head.load_state_dict(head.state_dict())
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD([*ref_head.parameters(), *(r.weight for r in reference)], lr=0.05)
    # The cached tables use their own fused SGD (lr 0.5); give the reference the same rate.
    ref_opt.param_groups[0]["params"] = list(ref_head.parameters())
    ref_opt.add_param_group({"params": [r.weight for r in reference], "lr": 0.5})
    return _Model(bags, head, opt), _Model(reference, ref_head, ref_opt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distcache demo", description=__doc__)
    ap.add_argument("--steps", type=positive_int, default=200)
    ap.add_argument("--batch-size", type=positive_int, default=256)
    ap.add_argument("--capacity", type=float, default=0.02)
    ap.add_argument("--lookahead", type=int, default=8)
    ap.add_argument("--prefetch-depth", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    config = CacheConfig(
        capacity=args.capacity,
        lookahead=args.lookahead,
        prefetch_depth=args.prefetch_depth,
        optimizer="sgd",
        learning_rate=0.5,
    )
    batches = _batches(
        TABLES, batch_size=args.batch_size, pooling=POOLING, steps=args.steps, seed=args.seed
    )
    cached, reference = _models(config, args.seed)
    log.info(
        "distcache demo: %d tables, %s rows in host memory, caches of %.0f %% "
        "(L=%d look-ahead, K=%d staged ahead), %d steps of %d samples",
        len(TABLES),
        f"{sum(t.num_embeddings for t in TABLES):,}",
        100 * args.capacity,
        args.lookahead,
        args.prefetch_depth,
        args.steps,
        args.batch_size,
    )
    seconds = _train(cached, reference, batches, args.lookahead, args.steps)
    _report_caches(cached, reference, seconds, args.steps * args.batch_size)
    _compare_policies(batches, config, args.batch_size)
    return 0


def _train(
    cached: _Model, reference: _Model, batches: list[_Batch], lookahead: int, steps: int
) -> float:
    """Train both models on `batches`, logging the cached one's loss; returns the seconds."""
    bags = cached.bags
    assert isinstance(bags, CachedEmbeddingBags)
    loss_fn = nn.BCEWithLogitsLoss()
    start, enqueued, window = time.perf_counter(), 0, []
    for step, (ids, offsets, labels) in enumerate(batches):
        while enqueued < len(batches) and enqueued <= step + lookahead:
            bags.enqueue(*batches[enqueued][:2])  # ids of future batches enter the window
            enqueued += 1
        bags.prefetch()  # stage rows up to K batches ahead
        loss = loss_fn(cached.head(bags(ids, offsets)).squeeze(1), labels)
        bags.prefetch()  # overlaps the next batches' staging with this one's training
        cached.optimizer.zero_grad()
        loss.backward()  # the caches' fused optimizer updates the rows here
        cached.optimizer.step()
        _reference_step(reference, loss_fn, ids, offsets, labels)
        window.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0:
            log.info("step %4d  loss %.4f", step + 1, sum(window) / len(window))
            window = []
    return time.perf_counter() - start


def _reference_step(
    model: _Model,
    loss_fn: nn.Module,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    labels: torch.Tensor,
) -> None:
    batch_size = labels.numel()
    outs = []
    for k, bag in enumerate(model.bags):
        lo, hi = int(offsets[k * batch_size]), int(offsets[(k + 1) * batch_size])
        outs.append(bag(ids[lo:hi], offsets[k * batch_size : (k + 1) * batch_size] - lo))
    loss = loss_fn(model.head(torch.cat(outs, 1)).squeeze(1), labels)
    model.optimizer.zero_grad()
    loss.backward()
    model.optimizer.step()


def _report_caches(cached: _Model, reference: _Model, seconds: float, samples: int) -> None:
    """What the caches did, and how far the cached tables are from the reference's."""
    bags = cached.bags
    assert isinstance(bags, CachedEmbeddingBags)
    log.info(
        "\nwhat the caches did (%.1f s, %.0f samples/s including the reference model):",
        seconds,
        samples / seconds,
    )
    for name, s in bags.stats().items():
        log.info(
            "  %-14s %7s rows cached of %9s | hit rate %5.1f %% | loads %8s | "
            "write-backs %8s | critical-path misses %d",
            name,
            f"{s.capacity:,}",
            f"{s.num_rows:,}",
            100 * s.hit_rate,
            f"{s.loads:,}",
            f"{s.writebacks:,}",
            s.critical_misses,
        )
    worst = max(
        (bags.table_weight(t.name) - r.weight.data).abs().max().item()
        for t, r in zip(TABLES, reference.bags, strict=True)
    )
    log.info(
        "  trained tables vs the same training without a cache: max |difference| = %.2g", worst
    )


def _compare_policies(batches: list[_Batch], config: CacheConfig, batch_size: int) -> None:
    """Loads of each policy on the 'user' table's ids, against Belady's optimum."""
    log.info("\npolicies on this job's 'user' id trace (rows loaded; lower is better):")
    trace = [b[0][: batch_size * POOLING] for b in batches]
    capacity = config.capacity_rows(TABLES[0].num_embeddings)
    optimum = None
    for policy in ("optimal", "lookahead", "lfu", "lru"):
        r = simulate(
            trace,
            num_rows=TABLES[0].num_embeddings,
            capacity=capacity,
            policy=policy,
            lookahead=config.lookahead,
            prefetch_depth=config.prefetch_depth,
        )
        optimum = optimum or r.loads
        log.info(
            "  %-9s loads %8s  (%.2f x optimum)  critical-path misses %8s",
            policy,
            f"{r.loads:,}",
            r.loads / optimum,
            f"{r.critical_misses:,}",
        )
