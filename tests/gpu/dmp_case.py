"""A small model under single-rank DMP with distcache's sharder, and its uncached twin.

Imports TorchRec: `test_dmp_cuda.py` imports this module only after `pytest.importorskip`.

The GPU machine has FBGEMM's CPU ops only, so everything TorchRec does with a
`KeyedJaggedTensor` stays on the host: batches keep their sparse features on the CPU (`to()`
moves only the dense features and labels), and the distcache kernel moves the routed ids to
its device. Embedding outputs, the dense part and the loss live on the device.

All values are small integers (weights, dense features, loss coefficients), lr is 1: every
result is exact in fp32, so cached and uncached, pipelined and plain training agree bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.streamable import Pipelineable

from distcache import CacheConfig
from distcache.sharding import CACHED_KERNEL, CachedEmbeddingBagCollectionSharder, cache_stats
from tests.distributed.sharded_model import copy_global_into

TABLES = [("t0", 400, 8), ("t1", 300, 8), ("t2", 200, 4)]  # (name, rows, dim); feature f<i>
FEATURES = [f"f{i}" for i in range(len(TABLES))]
DENSE = 4


@dataclass
class SparseBatch(Pipelineable):
    """A batch whose sparse features stay on the host (TorchRec's bookkeeping needs FBGEMM);
    `Pipelineable`, as TorchRec's pipelines require."""

    dense_features: torch.Tensor  # [B, DENSE] small integers
    sparse_features: KeyedJaggedTensor  # on the CPU, always
    labels: torch.Tensor  # [B]

    def to(self, device: torch.device, non_blocking: bool = False) -> SparseBatch:
        return SparseBatch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features,
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """The pipeline copies on its own stream and trains on another."""
        for t in (self.dense_features, self.labels):
            if t.is_cuda:
                t.record_stream(stream)


def batches(num: int, batch_size: int, seed: int) -> list[SparseBatch]:
    """Power-law ids (hot rows repeat, so small caches hit and evict), some bags empty."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        lengths = torch.randint(0, 4, (len(TABLES) * batch_size,), generator=gen)
        values = []
        for k, (_, rows, _) in enumerate(TABLES):
            n = int(lengths[k * batch_size : (k + 1) * batch_size].sum())
            u = torch.rand(n, generator=gen)
            values.append(((rows**u).long() - 1).clamp(0, rows - 1))
        kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(values), lengths)
        dense = torch.randint(-2, 3, (batch_size, DENSE), generator=gen).float()
        labels = torch.zeros(batch_size)
        out.append(SparseBatch(dense, kjt, labels))
    return out


def integer_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Initial weights `{table.weight: [rows, dim]}` and the dense layer's, small integers."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        f"ebc.embedding_bags.{name}.weight": torch.randint(-8, 8, (rows, dim), generator=gen)
        for name, rows, dim in TABLES
    }
    state["dense.weight"] = torch.randint(-2, 3, (1, DENSE), generator=gen)
    return {k: v.float() for k, v in state.items()}


def _logits(pooled: torch.Tensor, dense: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    weights = torch.arange(pooled.shape[1], dtype=pooled.dtype, device=pooled.device) % 3 - 1
    return (pooled * weights).sum(1) + linear(dense).squeeze(1)  # [B] integers


class TinyModel(nn.Module):
    """EBC (sharded by DMP) + one linear layer on `device`; `forward(batch) -> (loss, logits)`
    as `DLRMTrain`, with a loss whose gradients are integers."""

    def __init__(self, state: dict[str, torch.Tensor], device: torch.device):
        super().__init__()
        configs = [
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f])
            for (n, r, d), f in zip(TABLES, FEATURES, strict=True)
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        self.dense = nn.Linear(DENSE, 1, bias=False, device=device)
        with torch.no_grad():
            self.dense.weight.copy_(state["dense.weight"])

    def forward(self, batch: SparseBatch) -> tuple[torch.Tensor, torch.Tensor]:
        per_key = self.ebc(batch.sparse_features).to_dict()
        pooled = torch.cat([per_key[f] for f in FEATURES], dim=1)
        logits = _logits(pooled, batch.dense_features, self.dense)
        return logits.sum(), logits.detach()


class ReferenceModel(nn.Module):
    """The same model uncached: `nn.EmbeddingBag`s with sparse gradients, on the CPU."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(
                r,
                d,
                mode="sum",
                sparse=True,
                include_last_offset=True,  # a KJT's offsets close the last bag
                _weight=state[f"ebc.embedding_bags.{n}.weight"].clone(),
            )
            for n, r, d in TABLES
        )
        self.dense = nn.Linear(DENSE, 1, bias=False)
        with torch.no_grad():
            self.dense.weight.copy_(state["dense.weight"])

    def forward(self, batch: SparseBatch) -> tuple[torch.Tensor, torch.Tensor]:
        per_key = batch.sparse_features.to_dict()
        pooled = torch.cat(
            [
                bag(per_key[f].values(), per_key[f].offsets())
                for bag, f in zip(self.bags, FEATURES, strict=True)
            ],
            dim=1,
        )
        logits = _logits(pooled, batch.dense_features.cpu(), self.dense)
        return logits.sum(), logits.detach()


def process_group() -> dist.ProcessGroup:
    """A world of one rank (gloo: TorchRec's host-side collectives), created once."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def sharded(
    state: dict[str, torch.Tensor], config: CacheConfig, device: torch.device
) -> tuple[DistributedModelParallel, list[nn.Parameter]]:
    """`TinyModel` under DMP, every table table-wise on rank 0 behind distcache's cache on
    `device`, loaded with `state`; returns it and the dense parameters (trained by a plain SGD)."""
    model = TinyModel(state, device)
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 1.0})
    sharder = CachedEmbeddingBagCollectionSharder(config)
    module_plan = construct_module_sharding_plan(
        model.ebc,
        per_param_sharding={
            n: table_wise(rank=0, compute_kernel=CACHED_KERNEL) for n, *_ in TABLES
        },
        local_size=1,
        world_size=1,
        # On CUDA the plan places the shards on cuda:0 while the kernel's rows (checkpointed as
        # ShardedTensors, `distcache/sharding/state.py`) are pinned host tensors.
        device_type=device.type,
        sharder=sharder,
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(process_group()),
        device=device,
        plan=ShardingPlan({"ebc": module_plan}),
        sharders=[sharder],
        init_data_parallel=False,  # one rank; the dense layer stays where it was built
    )
    copy_global_into(dmp, state)
    return dmp, list(model.dense.parameters())


def table_weights(dmp: nn.Module) -> dict[str, torch.Tensor]:
    """Each table's rows after training (the state dict flushes the caches first)."""
    out = {}
    for key, value in dmp.state_dict().items():
        if hasattr(value, "local_shards"):
            (shard,) = value.local_shards()
            out[key.removeprefix("module.")] = shard.tensor.detach().cpu().clone()
    return out


def total_stats(dmp: nn.Module) -> dict[str, float]:
    stats = [s.as_dict() for s in cache_stats(dmp).values()]
    return {
        k: sum(s[k] for s in stats)
        for k in ("loads", "evictions", "writebacks", "critical_misses", "graph_replays")
    }
