"""fp16 tables through distcache's kernel against the same tables through TorchRec's own fused
kernel (FBGEMM), sharded alike on gloo ranks, trained side by side."""

from __future__ import annotations

import dataclasses

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from distcache import CacheConfig
from tests.distributed.sharded_model import (
    TABLES,
    copy_global_into,
    global_batches,
    local_slice,
    loss_of,
    make_ebc,
    per_table_plan,
    shard,
)


def _torchrec_plan(kind: str, world: int) -> dict:
    ranks = list(range(world))
    per_table = {
        "table_wise": lambda i: table_wise(rank=i % world, compute_kernel="fused"),
        "row_wise": lambda i: row_wise(compute_kernel="fused"),
        "column_wise": lambda i: column_wise(ranks=ranks, compute_kernel="fused"),
    }[kind]
    return {name: per_table(i) for i, (name, *_) in enumerate(TABLES)}


def _local(model) -> dict[str, torch.Tensor]:
    return {
        key: shard.tensor.clone()
        for key, value in model.state_dict().items()
        for shard in value.local_shards()
    }


def train_against_torchrec(rank: int, world: int, kind: str, steps: int = 10) -> dict:
    """Returns how far apart the two models ended, and how far they moved."""
    torch.manual_seed(0)
    ours_src, theirs_src = make_ebc(data_type="FP16"), make_ebc(data_type="FP16")
    gen = torch.Generator().manual_seed(0)
    start = {
        k: (torch.randint(-8, 8, v.shape, generator=gen) / 8).to(v.dtype)
        for k, v in sorted(ours_src.state_dict().items())
    }
    for src in (ours_src, theirs_src):
        apply_optimizer_in_backward(torch.optim.SGD, src.embedding_bags.parameters(), {"lr": 0.1})
    config = CacheConfig(capacity=14, lookahead=2, prefetch_depth=1)
    big = dataclasses.replace(config, capacity=28)  # t3 serves two features
    ours = shard(ours_src, kind, config, {"t3": big})
    theirs = per_table_plan(
        theirs_src,
        "",
        theirs_src,
        _torchrec_plan(kind, world),
        EmbeddingBagCollectionSharder(),
        init_data_parallel=False,
    )
    for model in (ours, theirs):
        copy_global_into(model, start)
    before = _local(ours)
    out_gap = 0.0
    for batch in global_batches(steps, 3, world, seed=1):
        local = local_slice(batch, rank, world)
        ours_out, theirs_out = ours(local), theirs(local)
        a, b = ours_out.to_dict(), theirs_out.to_dict()
        out_gap = max(out_gap, max(float((a[f] - b[f]).detach().abs().max()) for f in a))
        assert all(v.dtype == torch.float32 for v in a.values())
        loss_of(ours_out).backward()
        loss_of(theirs_out).backward()
    after, reference = _local(ours), _local(theirs)
    stores = [
        e.store.weights.dtype
        for m in ours.modules()
        if hasattr(m, "cached_kernels")
        for k in m.cached_kernels()
        for e in k.bags.engines
    ]
    return {
        "dtypes": sorted({str(t.dtype) for t in after.values()} | {str(d) for d in stores}),
        "gap": max(float((after[k].float() - reference[k].float()).abs().max()) for k in after),
        "moved": max(float((after[k].float() - before[k].float()).abs().max()) for k in after),
        "out_gap": out_gap,
    }
