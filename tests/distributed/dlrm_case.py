"""torchrec.models.dlrm.DLRM under DMP: distcache's sharder vs TorchRec's default sharder."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import table_wise
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from distcache import CacheConfig
from distcache.sharding import CACHED_KERNEL, CachedEmbeddingBagCollectionSharder, cache_stats
from tests.distributed.sharded_model import copy_global_into, per_table_plan

ROWS = [3000, 1200, 5000, 800, 2500, 600]
DIM = 8
DENSE = 13


def _dlrm() -> DLRM:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=r, embedding_dim=DIM, feature_names=[f"f{i}"]
        )
        for i, r in enumerate(ROWS)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )


def _batches(rank: int, steps: int, batch: int):
    gen = torch.Generator().manual_seed(100 + rank)
    keys = [f"f{i}" for i in range(len(ROWS))]
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(ROWS) * batch,), generator=gen)
        values = []
        for k, rows in enumerate(ROWS):
            n = int(lengths[k * batch : (k + 1) * batch].sum())
            u = torch.rand(n, generator=gen)
            values.append(((rows**u).long() - 1).clamp(0, rows - 1))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), lengths)
        dense = torch.randn(batch, DENSE, generator=gen)
        labels = (torch.rand(batch, generator=gen) < 0.3).float()
        yield dense, kjt, labels


def _sharded(model: DLRM, sharder, kernel: str) -> DistributedModelParallel:
    world = dist.get_world_size()
    per_table = {
        f"t{i}": table_wise(rank=i % world, compute_kernel=kernel) for i in range(len(ROWS))
    }
    ebc = model.sparse_arch.embedding_bag_collection
    return per_table_plan(model, "sparse_arch.embedding_bag_collection", ebc, per_table, sharder)


def train_both(rank: int, world: int, steps: int = 20, capacity: float = 0.05) -> dict:
    """Train the same DLRM with both sharders on the same batches; return both loss curves."""
    torch.manual_seed(0)
    base = _dlrm()
    state = copy.deepcopy(base.state_dict())
    losses, stats = {}, {}
    for name in ("torchrec", "distcache"):
        model = copy.deepcopy(base)
        ebc = model.sparse_arch.embedding_bag_collection
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
        if name == "torchrec":
            dmp = _sharded(model, EmbeddingBagCollectionSharder(), "fused")
        else:
            sharder = CachedEmbeddingBagCollectionSharder(
                CacheConfig(capacity=capacity, lookahead=2, prefetch_depth=1)
            )
            dmp = _sharded(model, sharder, CACHED_KERNEL)
        copy_global_into(dmp, state)
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=0.1),
        )
        loss_fn = torch.nn.BCEWithLogitsLoss()
        curve = []
        for dense_x, kjt, labels in _batches(rank, steps, batch=16):
            loss = loss_fn(dmp(dense_x, kjt).squeeze(1), labels)
            dense.zero_grad()
            loss.backward()
            dense.step()
            curve.append(loss.item())
        losses[name] = curve
        if name == "distcache":
            stats = {k: s.as_dict() for k, s in cache_stats(dmp).items()}
    return {"losses": losses, "stats": stats}
