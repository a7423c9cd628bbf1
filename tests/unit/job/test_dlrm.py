"""distcache.job.dlrm in one process: a world of one gloo rank (FileStore in a tmp dir)."""

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from distcache import CacheConfig, DistcacheConfigError
from distcache.cache.capacity import pinned_batches
from distcache.job.dlrm import (
    EBC_PATH,
    UVM_CACHING_KERNEL,
    DLRMConfig,
    apply_embedding_optimizer,
    build_dlrm,
    cached_sharder,
    dense_optimizer,
    host_embedding_dlrm,
    shard_dlrm,
    sharding_plan,
    small_tables,
    whole_tables,
)
from distcache.sharding import CachedEmbeddingBagCollectionSharder, cache_stats

CONFIG = DLRMConfig(rows=(200, 3000, 7), dim=8, dense_hidden=(16,), over_hidden=(16,))
BATCH = 32


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    values = torch.cat([torch.randint(0, r, (BATCH,), generator=gen) for r in CONFIG.rows])
    lengths = torch.ones(CONFIG.num_tables * BATCH, dtype=torch.int64)
    return Batch(
        dense_features=torch.randn(BATCH, CONFIG.dense_in_features, generator=gen),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(CONFIG.feature_names, values, lengths),
        labels=(torch.rand(BATCH, generator=gen) < 0.3).float(),
    )


def _train(model, steps: int = 2) -> list[float]:
    optimizer = dense_optimizer(model, lambda params: torch.optim.SGD(params, lr=0.1))
    losses = []
    for step in range(steps):
        loss, _ = model(_batch(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_config_is_validated():
    assert CONFIG.feature_names == ["f0", "f1", "f2"]
    with pytest.raises(DistcacheConfigError, match="rows"):
        DLRMConfig(rows=())
    with pytest.raises(DistcacheConfigError, match="dense_hidden"):
        DLRMConfig(rows=(4,), dense_hidden=(0,))
    with pytest.raises(DistcacheConfigError, match="dim"):
        DLRMConfig(rows=(4,), dim=True)


def test_tables_too_small_for_the_batches_in_flight_are_cached_whole():
    config = CacheConfig(capacity=0.1, lookahead=4, prefetch_depth=2)
    assert pinned_batches(config) == 3
    assert pinned_batches(CacheConfig(policy="lru", lookahead=0, prefetch_depth=0)) == 1
    # 10 % of 200 rows = 20 < 64 ids in flight; 300 rows hold them; 7 rows < 64 but 1 row < 7.
    assert small_tables(CONFIG.rows, config, in_flight_ids=[64, 400, 1]) == ["t0", "t1"]
    whole = whole_tables(CONFIG.rows, config, in_flight_ids=64)
    assert sorted(whole) == ["t0", "t2"] and whole["t0"].capacity == 1.0
    assert whole["t0"].prefetch_depth == 2
    # Row-wise over 8 ranks: shards of 375 rows cache 38 < 64.
    assert "t1" in whole_tables(
        CONFIG.rows, config, in_flight_ids=64, sharding="row_wise", world_size=8
    )
    sharder = cached_sharder(CONFIG.rows, config, world_size=2, batch_size=8)  # 3 * 2 * 8 ids
    assert sorted(sharder.table_configs) == ["t0", "t2"]
    with pytest.raises(DistcacheConfigError, match="sharding"):
        whole_tables(CONFIG.rows, config, in_flight_ids=1, sharding="column_wise")
    with pytest.raises(DistcacheConfigError, match="embedding optimizer"):
        apply_embedding_optimizer(build_dlrm(CONFIG), "lamb", lr=0.1)


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_a_plan_on_torchrecs_uvm_cache(sharding):
    """`uvm_cache`: every table on TorchRec's fused_uvm_caching with the cache parameters given
    (what throughput.py's torchrec_uvm variants train on a GPU); not with distcache's sharder."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import CacheParams

    ebc = build_dlrm(CONFIG).get_submodule(EBC_PATH)
    cache = CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=0.02, prefetch_pipeline=True)
    plan = sharding_plan(
        ebc, EmbeddingBagCollectionSharder(), sharding=sharding, world_size=2,
        device_type="cuda", uvm_cache=cache,
    ).plan[EBC_PATH]  # fmt: skip
    assert sorted(plan) == ["t0", "t1", "t2"]
    for table in plan.values():
        assert (table.compute_kernel, table.cache_params) == (UVM_CACHING_KERNEL, cache)
        assert table.sharding_type == sharding
    with pytest.raises(DistcacheConfigError, match="EmbeddingBagCollectionSharder"):
        sharding_plan(
            ebc, CachedEmbeddingBagCollectionSharder(CacheConfig()), world_size=1,
            uvm_cache=cache,
        )  # fmt: skip


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_both_sharders_train_the_same_model_alike(world_of_one, sharding):
    losses = {}
    for name in ("torchrec", "distcache", "distcache, small tables resident"):
        model = build_dlrm(CONFIG, seed=3)
        apply_embedding_optimizer(model, "rowwise_adagrad", lr=0.1)
        sharder, resident = None, ()
        cache = CacheConfig(capacity=0.2, lookahead=1, prefetch_depth=1)
        if name == "distcache":
            sharder = cached_sharder(
                CONFIG.rows, cache, world_size=1, batch_size=BATCH, sharding=sharding
            )
            assert sorted(sharder.table_configs) == ["t0", "t2"]  # cached whole
        elif name != "torchrec":
            sharder = CachedEmbeddingBagCollectionSharder(cache)
            resident = ("t0", "t2")  # in TorchRec's fused kernel
        dmp = shard_dlrm(
            model, sharder, sharding=sharding, device=torch.device("cpu"), resident_tables=resident
        )
        losses[name] = _train(dmp)
        if sharder is not None:
            stats = cache_stats(dmp)
            assert sum(s.batches for s in stats.values()) > 0
            cached_rows = sum(s.num_rows for s in stats.values())
            assert cached_rows == (3000 if resident else sum(CONFIG.rows))
    for name in losses:
        assert losses[name] == pytest.approx(losses["torchrec"], rel=1e-5), name


def test_host_embeddings_train_like_the_sharded_model(world_of_one):
    losses = {}
    for name in ("dmp", "host"):
        model = build_dlrm(CONFIG, seed=5)
        apply_embedding_optimizer(model, "sgd", lr=0.1)
        if name == "dmp":
            losses[name] = _train(shard_dlrm(model, device=torch.device("cpu")))
        else:
            losses[name] = _train(host_embedding_dlrm(model, device=torch.device("cpu")))
    assert losses["host"] == pytest.approx(losses["dmp"], rel=1e-5)


def test_resident_tables_must_exist(world_of_one):
    sharder = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.5))
    with pytest.raises(DistcacheConfigError, match="t9"):
        shard_dlrm(build_dlrm(CONFIG), sharder, device=torch.device("cpu"), resident_tables=["t9"])
