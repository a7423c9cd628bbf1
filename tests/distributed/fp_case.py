"""TorchRec's `FeatureProcessedEmbeddingBagCollection` (position-weighted features: each id's
weight is learned, per position in its bag) sharded by TorchRec's FP sharder around distcache's
EBC sharder, against the same around TorchRec's own (`fused`): both train the embedding rows
and the position weights, the latter by the dense optimizer on each rank that applies them
(TorchRec keeps the feature processors in its sharded module: table-wise, on the table's
rank, after the ids are routed; row-wise, on every rank, before)."""

from __future__ import annotations

import dataclasses

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    row_wise,
    table_wise,
)
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from distcache import CacheConfig
from distcache.sharding import CACHED_KERNEL, CachedEmbeddingBagCollectionSharder, cache_stats
from tests.distributed.sharded_model import (
    FEATURES,
    TABLES,
    copy_global_into,
    global_batches,
    integer_init,
    local_slice,
    loss_of,
    make_ebc,
    per_table_plan,
)


def _model() -> FeatureProcessedEmbeddingBagCollection:
    ebc = make_ebc(weighted=True)
    integer_init(ebc, 3)
    positions = PositionWeightedModuleCollection(max_feature_lengths=dict.fromkeys(FEATURES, 4))
    return FeatureProcessedEmbeddingBagCollection(ebc, positions)


def fp_trained(rank: int, world: int, kind: str, hot: bool = False, steps: int = 6) -> dict:
    """Each kernel's outputs per step, then its tables' local shards and position weights
    (`hot`: distcache's t0 and t3 replicate some rows on every rank)."""
    batches = [local_slice(b, rank, world) for b in global_batches(steps, 3, world, seed=5)]
    state = _model().state_dict()
    runs = {}
    for kernel in ("fused", CACHED_KERNEL):
        model = _model()
        apply_optimizer_in_backward(
            torch.optim.SGD, model._embedding_bag_collection.parameters(), {"lr": 1.0}
        )
        config = CacheConfig(capacity=20, lookahead=2)
        replicas = {"t0": (0, 1, 2), "t3": (1, 0)} if hot else {}
        inner = (
            EmbeddingBagCollectionSharder()
            if kernel == "fused"
            else CachedEmbeddingBagCollectionSharder(
                config, {t: dataclasses.replace(config, hot_rows=r) for t, r in replicas.items()}
            )
        )
        sharder = FeatureProcessedEmbeddingBagCollectionSharder(inner)
        shard = {
            "table_wise": lambda i, k=kernel: table_wise(rank=i % world, compute_kernel=k),
            "row_wise": lambda i, k=kernel: row_wise(compute_kernel=k),
        }[kind]
        per_table = {name: shard(i) for i, (name, *_) in enumerate(TABLES)}
        dmp = per_table_plan(model, "", model, per_table, sharder)
        copy_global_into(dmp, state)
        dense = torch.optim.SGD(
            [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=1.0
        )
        outputs = []
        for batch in batches:
            out = dmp(batch)
            dense.zero_grad()
            loss_of(out).backward()
            dense.step()
            outputs.append({f: t.detach() for f, t in out.to_dict().items()})
        runs[kernel] = {
            "outputs": outputs,
            "tables": {
                k: [s.tensor.clone() for s in v.local_shards()]
                for k, v in dmp.state_dict().items()
                if hasattr(v, "local_shards")
            },
            "positions": {
                k: v.detach().clone() for k, v in dmp.named_parameters() if "position" in k
            },
            "loads": sum(s.loads for s in cache_stats(dmp).values()),
        }
    return runs
