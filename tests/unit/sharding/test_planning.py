"""`CachedShardingPlanner`'s storage estimate on a GPU topology (planned here, without a GPU):
a distcache table holds its rows in host memory and a cache of them in device memory, priced
against TorchRec's estimate of its own UVM cache of the same load factor."""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.types import CacheParams
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from distcache import CacheConfig, DistcacheConfigError
from distcache.cache.capacity import CACHE_ROW_INDEX_BYTES_LOOKAHEAD, CACHE_SLOT_BYTES
from distcache.sharding import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedShardingPlanner,
    cached_estimators,
)

ROWS, DIM = 10_000_000, 64  # 2.56 GB of fp32 rows
GPU = Topology(world_size=1, compute_device="cuda", hbm_cap=2**30, ddr_cap=64 * 2**30)


def _ebc() -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="big", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f"]
            )
        ],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.05})
    return ebc


def _option(estimators, sharder, constraints=None, topology=GPU, sharding="table_wise"):
    """The option of the table sharded as `sharding`, its storage estimated."""
    enumerator = EmbeddingEnumerator(topology, 512, constraints=constraints, estimator=estimators)
    options = enumerator.enumerate(_ebc(), [sharder])
    (option,) = [o for o in options if o.sharding_type == sharding]
    return option


def _uvm_estimate(load_factor: float, topology=GPU, sharding="table_wise"):
    """TorchRec's estimate of a shard of its own UVM cache (`fused_uvm_caching`) of
    `load_factor`."""
    sharder = EmbeddingBagCollectionSharder(fused_params={"cache_load_factor": load_factor})
    enumerator = EmbeddingEnumerator(topology, 512)
    options = enumerator.enumerate(_ebc(), [sharder])
    (option,) = [
        o
        for o in options
        if o.sharding_type == sharding and o.compute_kernel == "fused_uvm_caching"
    ]
    return option.shards[0].storage


@pytest.mark.parametrize(
    ("capacity", "sharding"),
    [(0.02, "table_wise"), (200_000, "table_wise"), (0.02, "row_wise"), (200_000, "row_wise")],
)
def test_a_gpu_holds_the_cache_and_the_host_the_rows_as_torchrecs_uvm_cache(capacity, sharding):
    """Row-wise on 2 GPUs: a capacity of N rows is N rows a shard (the engine's reading)."""
    gpus = Topology(world_size=2, compute_device="cuda", hbm_cap=2**30, ddr_cap=64 * 2**30)
    config = CacheConfig(capacity=capacity)
    sharder = CachedEmbeddingBagCollectionSharder(config)
    estimators = cached_estimators(gpus, config_for=lambda t, m: config)
    option = _option(estimators, sharder, topology=gpus, sharding=sharding)
    assert option.compute_kernel == CACHED_KERNEL and option.cache_params is None  # restored
    rows = ROWS // len(option.shards)
    slots = config.capacity_rows(rows)
    uvm = _uvm_estimate(slots / rows, gpus, sharding)
    maps = rows * CACHE_ROW_INDEX_BYTES_LOOKAHEAD + slots * CACHE_SLOT_BYTES
    for shard in option.shards:
        assert (shard.storage.hbm, shard.storage.ddr) == (uvm.hbm + maps, uvm.ddr)
        assert shard.storage.hbm < 2**30 < rows * DIM * 4 < shard.storage.ddr


def test_the_planner_places_a_table_larger_than_the_gpu_behind_a_cache_that_fits():
    """TorchRec's estimator alone prices the customized kernel's whole table in device memory:
    2.56 GB on a 1 GB GPU fits nowhere. A 2 % cache does; a 90 % one does not."""
    small = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.02))
    plan = CachedShardingPlanner(GPU, batch_size=512).plan(_ebc(), [small]).plan[""]
    assert plan["big"].compute_kernel == CACHED_KERNEL
    assert plan["big"].cache_config.capacity == 0.02
    large = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.9))
    with pytest.raises(PlannerError, match="insufficient storage"):
        CachedShardingPlanner(GPU, batch_size=512).plan(_ebc(), [large])


def test_torchrecs_load_factor_sizes_the_cache_it_is_planned_with():
    """A table's `ParameterConstraints(cache_params=CacheParams(load_factor=...))`, TorchRec's
    per-table cache size, sizes its distcache cache, in the estimate and in the plan."""
    sharder = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.02))
    constraints = {"big": ParameterConstraints(cache_params=CacheParams(load_factor=0.1))}
    option = _option(cached_estimators(GPU, constraints), sharder, constraints)
    maps = ROWS * CACHE_ROW_INDEX_BYTES_LOOKAHEAD + ROWS // 10 * CACHE_SLOT_BYTES
    assert option.shards[0].storage.hbm == _uvm_estimate(0.1).hbm + maps
    planner = CachedShardingPlanner(GPU, batch_size=512, constraints=constraints)
    plan = planner.plan(_ebc(), [sharder]).plan[""]
    assert plan["big"].cache_config.capacity == 0.1


def test_on_cpu_the_estimate_is_torchrecs():
    cpu = Topology(world_size=1, compute_device="cpu")
    sharder = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.02))
    enumerator = EmbeddingEnumerator(cpu, 512, estimator=cached_estimators(cpu))
    (option,) = [
        o for o in enumerator.enumerate(_ebc(), [sharder]) if o.sharding_type == "table_wise"
    ]
    storage = option.shards[0].storage
    assert storage.hbm == 0 and storage.ddr > ROWS * DIM * 4


@pytest.mark.parametrize("factor", [0.0, 1.5])
def test_a_load_factor_outside_0_1_is_refused_naming_the_table(factor):
    sharder = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.02))
    constraints = {"big": ParameterConstraints(cache_params=CacheParams(load_factor=factor))}
    planner = CachedShardingPlanner(GPU, batch_size=512, constraints=constraints)
    with pytest.raises(DistcacheConfigError) as refused:
        planner.plan(_ebc(), [sharder])
    assert str(refused.value) == (
        f"CacheParams.load_factor={factor} of 'big' is invalid: expected the fraction of its "
        "rows cached, in (0, 1]"
    )
