"""`fused_params={"output_dtype": ...}` (TorchRec's half-precision outputs): distcache's kernel
against TorchRec's `fused`, the same EBC and batches, integer rows (every sum exact)."""

from __future__ import annotations

import dataclasses

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import row_wise, table_wise
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from distcache import CacheConfig
from distcache.sharding import CACHED_KERNEL, CachedEmbeddingBagCollectionSharder
from tests.distributed.sharded_model import (
    TABLES,
    copy_global_into,
    global_batches,
    integer_init,
    local_slice,
    loss_of,
    make_ebc,
    per_table_plan,
)


def half_outputs(rank: int, world: int, kind: str, hot: bool = False, steps: int = 5) -> dict:
    """Each kernel's outputs per step (their dtype kept), then its tables' local shards
    (`hot`: distcache's t0 replicates its rows 0-2 on every rank)."""
    batches = [local_slice(b, rank, world) for b in global_batches(steps, 3, world, seed=9)]
    fused_params = {"output_dtype": SparseType.FP16}
    runs = {}
    for kernel in ("fused", CACHED_KERNEL):
        ebc = make_ebc()
        integer_init(ebc, 4)
        state = {k: v.clone() for k, v in ebc.state_dict().items()}
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
        config = CacheConfig(capacity=20)
        tables = {"t0": dataclasses.replace(config, hot_rows=(0, 1, 2))} if hot else {}
        sharder = (
            EmbeddingBagCollectionSharder(fused_params=fused_params)
            if kernel == "fused"
            else CachedEmbeddingBagCollectionSharder(config, tables, fused_params=fused_params)
        )
        shard = {
            "table_wise": lambda i, k=kernel: table_wise(rank=i % world, compute_kernel=k),
            "row_wise": lambda i, k=kernel: row_wise(compute_kernel=k),
        }[kind]
        per_table = {name: shard(i) for i, (name, *_) in enumerate(TABLES)}
        dmp = per_table_plan(ebc, "", ebc, per_table, sharder, kernel, init_data_parallel=False)
        copy_global_into(dmp, state)
        outputs = []
        for batch in batches:
            out = dmp(batch)
            loss_of(out).float().backward()
            outputs.append({f: t.detach() for f, t in out.to_dict().items()})
        runs[kernel] = {
            "outputs": outputs,
            "tables": {
                k: [s.tensor.clone() for s in v.local_shards()]
                for k, v in dmp.state_dict().items()
                if hasattr(v, "local_shards")
            },
        }
    return runs
