"""A plan made for CUDA places shards on `cuda:i`, but distcache's rows live in host memory:
the kernel's shard metadata must say so, or DMP fails while building the state dict. Checked
here without a GPU by sharding a CUDA plan onto a CPU process."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks


def _cuda_plan_on_cpu(rank: int, world: int) -> list[str]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from distcache import CacheConfig
    from distcache.sharding import CACHED_KERNEL, CachedEmbeddingBagCollectionSharder

    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=100, embedding_dim=8, feature_names=["f0"])
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.5))
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={"t0": table_wise(rank=0, compute_kernel=CACHED_KERNEL)},
        local_size=world,
        world_size=world,
        device_type="cuda",
        sharder=sharder,
    )
    model = DistributedModelParallel(
        ebc,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 5, 7]), torch.tensor([2, 1]))
    model(kjt).values().sum().backward()
    state = model.state_dict()
    return [str(s.tensor.device) for v in state.values() for s in v.local_shards()]


@pytest.mark.timeout(120)
def test_a_cuda_plan_shards_onto_host_rows():
    [devices] = run_ranks(_cuda_plan_on_cpu, 1, timeout_s=100)
    assert devices == ["cpu"]
