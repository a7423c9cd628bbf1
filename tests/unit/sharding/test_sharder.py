"""The sharder and planner integration, in one process (no process group needed)."""

import logging
import math

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints

from distcache import CacheConfig, DistcacheConfigError
from distcache.sharding import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedParameterSharding,
    CachedShardingPlanner,
    attach_cache_configs,
    cached_estimators,
)
from distcache.sharding.kernel import cache_config_from_fused_params
from distcache.sharding.parameter_sharding import (
    CACHE_CAPACITY_KEY,
    CACHE_CONFIG_KEY,
    GROUPED_CAPACITY,
)


def _ebc():
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=1000 * (i + 1), embedding_dim=16, feature_names=[f"f{i}"]
        )
        for i in range(4)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def test_offers_cached_kernel_and_row_wise_on_cpu():
    sharder = CachedEmbeddingBagCollectionSharder()
    assert "row_wise" in sharder.sharding_types("cpu")
    assert "table_row_wise" in sharder.sharding_types("cpu")
    for kind in ("table_wise", "row_wise", "column_wise", "table_row_wise"):
        assert sharder.compute_kernels(kind, "cpu") == [CACHED_KERNEL]
    assert CACHED_KERNEL not in sharder.compute_kernels("data_parallel", "cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchrec_planner_chooses_the_cached_kernel(device):
    topology = Topology(world_size=2, compute_device=device)
    enumerator = EmbeddingEnumerator(topology, 512, estimator=cached_estimators(topology))
    sharder = CachedEmbeddingBagCollectionSharder(
        CacheConfig(capacity=0.05), {"t2": CacheConfig(capacity=0.5)}
    )
    plan = EmbeddingShardingPlanner(topology=topology, enumerator=enumerator).plan(
        _ebc(), [sharder]
    )
    module_plan = plan.plan[""]
    assert {p.compute_kernel for p in module_plan.values()} == {CACHED_KERNEL}
    attached = attach_cache_configs(plan, sharder).plan[""]
    assert all(isinstance(p, CachedParameterSharding) for p in attached.values())
    assert attached["t2"].cache_config.capacity == 0.5
    # The capacity travels apart from the config that groups tables into kernels.
    for name, capacity in (("t0", 0.05), ("t2", 0.5)):
        assert attached[name].get_additional_fused_params() == {
            CACHE_CONFIG_KEY: CacheConfig(capacity=GROUPED_CAPACITY),
            CACHE_CAPACITY_KEY: capacity,
        }


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_cached_planner_plans_and_attaches_cache_configs(device):
    """`CachedShardingPlanner` is the ordinary planner done right: TorchRec's own planner with
    default estimators refuses the cached kernel."""
    sharder = CachedEmbeddingBagCollectionSharder(
        CacheConfig(capacity=0.05), {"t2": CacheConfig(capacity=0.5)}
    )
    topology = Topology(world_size=2, compute_device=device)
    with pytest.raises(ValueError, match="customized_kernel"):
        EmbeddingShardingPlanner(topology=topology).plan(_ebc(), [sharder])
    plan = CachedShardingPlanner(topology, batch_size=4).plan(_ebc(), [sharder]).plan[""]
    assert {p.compute_kernel for p in plan.values()} == {CACHED_KERNEL}
    assert plan["t2"].cache_config.capacity == 0.5
    assert plan["t0"].cache_config == CacheConfig(capacity=0.05)
    assert {r for p in plan.values() for r in p.ranks} == {0, 1}
    one = CachedShardingPlanner(batch_size=4).plan(_ebc(), [sharder]).plan[""]
    assert {r for p in one.values() for r in p.ranks} == {0}  # no process group: a world of 1


def test_the_cached_planner_raises_caches_too_small_for_the_batches_in_flight(caplog):
    """Before any batch: 2 ranks x 64 samples x 1.5 ids of a feature, 3 batches in flight
    (K = 2), use up to 576 rows of a shard; a 30 % cache of a shard under 1,920 rows cannot
    hold them."""
    config = CacheConfig(capacity=0.3, lookahead=2, prefetch_depth=2)
    sharder = CachedEmbeddingBagCollectionSharder(config)
    topology = Topology(world_size=2, compute_device="cpu")
    constraints = {f"t{i}": ParameterConstraints(pooling_factors=[1.5]) for i in range(4)}
    planner = CachedShardingPlanner(topology, batch_size=64, constraints=constraints)
    with caplog.at_level(logging.WARNING, logger="distcache.cache.capacity"):
        plan = planner.plan(_ebc(), [sharder]).plan[""]
    records = [r for r in caplog.records if r.name == "distcache.cache.capacity"]
    said = " ".join(r.getMessage() for r in records)
    rows = {name: max(s.shard_sizes[0] for s in p.sharding_spec.shards) for name, p in plan.items()}
    short = sorted(name for name, n in rows.items() if config.capacity_rows(n) < min(n, 576))
    assert 0 < len(short) < len(rows) and sorted(s.table for s in planner.shortfalls) == short
    assert len(records) == 1  # the short tables in one line
    for name, p in plan.items():  # a row-wise shard is judged as if every id fell in it
        need = min(rows[name], 576)
        if name in short:
            assert p.cache_config.capacity_rows(rows[name]) == need, name
            after = f"all {need:,}" if need == rows[name] else f"{need:,} of {rows[name]:,}"
            assert f"{name!r} {math.ceil(rows[name] * 0.3):,} -> {after}" in said, said
        else:
            assert p.cache_config == config
    # Told the batches' ids, it takes them instead of TorchRec's pooling factors.
    told = CachedShardingPlanner(topology, batch_size=64, ids_per_batch={"t0": 10})
    told.plan(_ebc(), [sharder])
    assert told.shortfalls == []


def test_fused_params_set_the_optimizer_the_torchrec_way():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    config = cache_config_from_fused_params(
        {
            CACHE_CONFIG_KEY: CacheConfig(capacity=0.1),
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": 0.05,
            "eps": 1e-6,
        }
    )
    assert (config.capacity, config.optimizer, config.learning_rate, config.eps) == (
        0.1,
        "rowwise_adagrad",
        0.05,
        1e-6,
    )
    # A table's own fused params carry its capacity apart (the group's config has none).
    table = cache_config_from_fused_params(
        {CACHE_CONFIG_KEY: CacheConfig(capacity=GROUPED_CAPACITY), CACHE_CAPACITY_KEY: 300}
    )
    assert table == CacheConfig(capacity=300)
    with pytest.raises(DistcacheConfigError, match="lamb is not supported"):
        cache_config_from_fused_params({"optimizer": EmbOptimType.LAMB})


def test_table_configs_must_name_real_tables():
    with pytest.raises(DistcacheConfigError, match="expected CacheConfig"):
        CachedEmbeddingBagCollectionSharder(table_configs={"t0": {"capacity": 3}})


def test_torchrecs_cache_load_factor_sizes_the_caches():
    """`fused_params={"cache_load_factor": f}` (how TorchRec sizes its UVM cache) is the
    tables' capacity, not overwritten by the default config's (every row); beside another
    capacity of the config's own, or outside (0, 1], refused in one line."""
    sharder = CachedEmbeddingBagCollectionSharder(
        CacheConfig(lookahead=2), fused_params={"cache_load_factor": 0.05}
    )
    assert sharder.cache_config.capacity == 0.05 and sharder.cache_config.lookahead == 2
    assert sharder.config_for("t0").capacity == 0.05
    same = CachedEmbeddingBagCollectionSharder(
        CacheConfig(capacity=0.05), fused_params={"cache_load_factor": 0.05}
    )
    assert same.cache_config.capacity == 0.05
    with pytest.raises(DistcacheConfigError, match="both size the caches: give one"):
        CachedEmbeddingBagCollectionSharder(
            CacheConfig(capacity=0.1), fused_params={"cache_load_factor": 0.05}
        )
    with pytest.raises(DistcacheConfigError, match=r"cache_load_factor=1.5 .* in \(0, 1\]"):
        CachedEmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 1.5})
