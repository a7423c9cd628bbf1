"""Plain-torch references for the cache tests: uncached `nn.EmbeddingBag`s and torch optimizers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from distcache import CacheConfig, CachedEmbeddingBags, CachedEmbeddings, TableSpec

Batch = tuple[torch.Tensor, torch.Tensor]  # values [n], offsets [T * B + 1]


def make_tables(dims: list[int], rows: list[int], poolings: list[str] | None = None):
    poolings = poolings or ["sum"] * len(dims)
    return [
        TableSpec(name=f"t{i}", num_embeddings=r, embedding_dim=d, pooling=p)
        for i, (d, r, p) in enumerate(zip(dims, rows, poolings, strict=True))
    ]


def make_batches(
    tables: list[TableSpec],
    *,
    batch_size: int,
    num_batches: int,
    max_len: int,
    seed: int,
    alpha: float = 1.1,
) -> list[Batch]:
    """Table-major batches with power-law ids (hot rows repeat, so caches hit and evict)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_batches):
        lengths = torch.randint(0, max_len + 1, (len(tables) * batch_size,), generator=gen)
        values = []
        for k, t in enumerate(tables):
            n = int(lengths[k * batch_size : (k + 1) * batch_size].sum())
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            rank = (
                (t.num_embeddings**u).long() - 1
                if alpha == 1.0
                else (((t.num_embeddings ** (1 - alpha) - 1) * u + 1) ** (1 / (1 - alpha))).long()
                - 1
            )
            values.append((rank.clamp(0, t.num_embeddings - 1) * 7919) % t.num_embeddings)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out.append((torch.cat(values), offsets))
    return out


def integer_weights(tables: list[TableSpec], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-8, 8, (t.num_embeddings, t.embedding_dim), generator=gen).float()
        for t in tables
    ]


class ReferenceBags(nn.Module):
    """The same tables, uncached: one `nn.EmbeddingBag` (sparse gradients) per table."""

    def __init__(self, tables: list[TableSpec], weights: list[torch.Tensor]):
        super().__init__()
        self.tables = tables
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, sparse=True)
            for t in tables
        )
        for bag, w in zip(self.bags, weights, strict=True):
            bag.weight.data.copy_(w)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        batch_size = (offsets.numel() - 1) // len(self.tables)
        outs = []
        for k, bag in enumerate(self.bags):
            lo, hi = int(offsets[k * batch_size]), int(offsets[(k + 1) * batch_size])
            outs.append(bag(values[lo:hi], offsets[k * batch_size : (k + 1) * batch_size] - lo))
        return torch.cat(outs, dim=1)


class ReferenceRows(nn.Module):
    """The same tables, uncached, unpooled: one `nn.Embedding` (sparse gradients) per table,
    each id's row in the order of `values` (what `CachedEmbeddings` returns)."""

    def __init__(self, tables: list[TableSpec], weights: list[torch.Tensor]):
        super().__init__()
        self.embs = nn.ModuleList(
            nn.Embedding(t.num_embeddings, t.embedding_dim, sparse=True) for t in tables
        )
        for emb, w in zip(self.embs, weights, strict=True):
            emb.weight.data.copy_(w)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        batch_size = (offsets.numel() - 1) // len(self.embs)
        outs = []
        for k, emb in enumerate(self.embs):
            lo, hi = int(offsets[k * batch_size]), int(offsets[(k + 1) * batch_size])
            outs.append(emb(values[lo:hi]))
        return torch.cat(outs, dim=0)


class RowWiseAdagradReference(torch.optim.Optimizer):
    """FBGEMM's exact row-wise Adagrad on full tables with sparse gradients."""

    def __init__(self, params, lr: float, eps: float):
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.coalesce()
                rows, g = grad.indices()[0], grad.values()
                acc = self.state[p].setdefault("sum", torch.zeros(p.shape[0], 1))
                acc[rows] += g.square().mean(dim=1, keepdim=True)
                p[rows] -= group["lr"] * g / (acc[rows].sqrt() + group["eps"])


def reference_optimizer(config: CacheConfig, params):
    params = list(params)
    lr = config.learning_rate
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=config.eps)
    if config.optimizer == "rowwise_adagrad":
        return RowWiseAdagradReference(params, lr=lr, eps=config.eps)
    return torch.optim.SparseAdam(params, lr=lr, betas=(config.beta1, config.beta2), eps=config.eps)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per column and is an integer (exact in fp32)."""
    weights = torch.arange(out.shape[1], dtype=out.dtype, device=out.device) % 3 - 1
    return (out * weights).sum()


def train_both(
    tables: list[TableSpec],
    config: CacheConfig,
    batches: list[Batch],
    *,
    weights: list[torch.Tensor],
    use_window: bool = True,
    sequence: bool = False,
    ids_per_batch: float | None = None,
    evaluate: Mapping[int, Batch] | None = None,
    load: Mapping[int, list[torch.Tensor]] | None = None,
    device: str = "cpu",
):
    """Train cached and reference side by side; returns (cached, reference, outputs pairs).
    `sequence`: per-id rows (`CachedEmbeddings` against `nn.Embedding`s), not pooled bags.
    `evaluate`: after step t, both evaluate batch `evaluate[t]` (`eval()`, no gradient), its
    outputs paired after the step's; then, both load the tables' weights `load[t]`.
    `device`: the cached module's (the reference's is the CPU)."""
    module = CachedEmbeddings if sequence else CachedEmbeddingBags
    cached = module(tables, config, device=device, ids_per_batch=ids_per_batch)
    for t, w in zip(tables, weights, strict=True):
        cached.load_table_weight(t.name, w)
    ref = (ReferenceRows if sequence else ReferenceBags)(tables, weights)
    opt = reference_optimizer(config, ref.parameters())
    ref.optimizer = opt
    pairs = []
    enqueued = 0
    for t, batch in enumerate(batches):
        if use_window:
            while enqueued < len(batches) and enqueued <= t + config.lookahead:
                cached.enqueue(*batches[enqueued])
                enqueued += 1
            cached.prefetch()
        out = cached(*batch)
        if use_window:
            cached.prefetch()
        loss_of(out).backward()
        ref_out = ref(*batch)
        opt.zero_grad()
        loss_of(ref_out).backward()
        opt.step()
        pairs.append((out.detach(), ref_out.detach()))
        if evaluate and t in evaluate:
            pairs.append(_evaluated((cached, ref), evaluate[t]))
        if load and t in load:
            for table, w, param in zip(tables, load[t], ref.parameters(), strict=True):
                cached.load_table_weight(table.name, w)
                param.data.copy_(w)
    return cached, ref, pairs


def _evaluated(modules: tuple[nn.Module, ...], batch: Batch) -> tuple[torch.Tensor, ...]:
    """Each module's output for `batch` in eval mode, without gradients."""
    outs = []
    for module in modules:
        module.eval()
        with torch.no_grad():
            outs.append(module(*batch))
        module.train()
    return tuple(outs)


def updated_below_half_a_gap(
    config: CacheConfig, dtype: torch.dtype, device: str, steps: int = 40
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A table of 64 `dtype` rows at 1.0, trained `steps` times by SGD on a batch of every
    row (one a bag), each step moving a value by a sixteenth of the gap from 1.0 to the next
    value up (or not at all: `loss_of`'s gradient is -1, 0 or 1 per column). Returns how far
    each value moved `[64, 8]`, its error against fp32 SGD in the columns that trained, and
    the gap."""
    torch.manual_seed(0)
    gap = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    tables = [TableSpec(name="t0", num_embeddings=64, embedding_dim=8, dtype=dtype)]
    config = dataclasses.replace(config, learning_rate=gap / 16)
    cached = CachedEmbeddingBags(tables, config, device=device)
    cached.load_table_weight("t0", torch.ones(64, 8))
    batch = (torch.arange(64), torch.arange(65))
    for _ in range(steps):
        loss_of(cached(*batch)).backward()
    moved = cached.table_weight("t0").float() - 1.0
    expected = -(torch.arange(8) % 3 - 1) * (steps * gap / 16)  # fp32 SGD's, per column
    return moved, (moved - expected)[:, expected != 0], gap
