"""LookaheadTrainPipeline vs the plain (non-pipelined) loop, and TorchRec's
`TrainPipelineSparseDist` and `PrefetchTrainPipelineSparseDist` (its streams emulated on CPU:
`prefetch_pipeline.py`) over the same distcache-sharded model, on the same DMP model and
data."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from distcache import CacheConfig, DistcacheConfigError, LookaheadWindowError
from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding import CACHED_KERNEL, CachedEmbeddingBagCollectionSharder, cache_stats
from tests.distributed.dlrm_case import ROWS, _batches, _dlrm
from tests.distributed.prefetch_pipeline import CpuPrefetchPipeline, CpuSemiSyncPipeline
from tests.distributed.sharded_model import (
    copy_global_into,
    evaluated,
    local_shards,
    per_table_plan,
)


def _model() -> DLRMTrain:
    return DLRMTrain(_dlrm())


def _shard(model: DLRMTrain, kind: str, config: CacheConfig) -> DistributedModelParallel:
    world = dist.get_world_size()
    make = {
        "table_wise": lambda i: table_wise(rank=i % world, compute_kernel=CACHED_KERNEL),
        "row_wise": lambda i: row_wise(compute_kernel=CACHED_KERNEL),
        # t0 cached on rank 0, the rest on TorchRec's kernel: rank 1 holds no cache
        "one_cached": lambda i: table_wise(rank=i % world, compute_kernel=CACHED_KERNEL),
    }[kind]
    per_table = {f"t{i}": make(i) for i in range(len(ROWS))}
    kernels = {
        name: CACHED_KERNEL if kind != "one_cached" or name == "t0" else "fused"
        for name in per_table
    }
    ebc = model.model.sparse_arch.embedding_bag_collection
    sharder = CachedEmbeddingBagCollectionSharder(config)
    return per_table_plan(
        model, "model.sparse_arch.embedding_bag_collection", ebc, per_table, sharder, kernels
    )


def _trainable(
    model: DLRMTrain, kind: str, config: CacheConfig
) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """`model` with its tables' SGD in backward, sharded (`_shard`), and its dense optimizer."""
    ebc = model.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    dmp = _shard(model, kind, config)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return dmp, dense


def _local_batches(rank: int, steps: int) -> list[Batch]:
    """This rank's batches of 16 samples."""
    return [
        Batch(dense_features=x, sparse_features=kjt, labels=y)
        for x, kjt, y in _batches(rank, steps, batch=16)
    ]


def pipelined_vs_plain(
    rank: int,
    world: int,
    kind: str,
    steps: int = 40,
    lookahead: int = 3,
    depth: int = 2,
    fused: bool = False,
) -> dict:
    torch.manual_seed(0)
    base = _model()
    state = copy.deepcopy(base.state_dict())
    batches = _local_batches(rank, steps)
    # Small enough to evict: a row-wise shard sees a share of the ids, a table owner all of them.
    capacity = {"table_wise": 0.15, "row_wise": 0.08, "one_cached": 0.15}[kind]
    config = CacheConfig(capacity=capacity, lookahead=lookahead, prefetch_depth=depth, fused=fused)
    runs = {}
    for name in ("plain", "pipeline", "torchrec_pipeline", "torchrec_prefetch"):
        dmp, dense = _trainable(copy.deepcopy(base), kind, config)
        copy_global_into(dmp, state)
        logits = []
        if name == "plain":
            for batch in batches:
                loss, (_, out, _) = dmp(batch)
                dense.zero_grad()
                loss.backward()
                dense.step()
                logits.append(out)
        else:
            if name == "torchrec_pipeline":  # TorchRec's own pipeline over distcache's kernel
                pipeline = TrainPipelineSparseDist(dmp, dense, torch.device("cpu"))
            elif name == "torchrec_prefetch":  # and its prefetch pipeline (`prefetch` hook)
                pipeline = CpuPrefetchPipeline(dmp, dense)
            else:
                try:
                    LookaheadTrainPipeline(dmp, dense, torch.device("cpu"), lookahead=lookahead + 1)
                    raise AssertionError("a window longer than the caches' lookahead was accepted")
                except DistcacheConfigError as err:
                    assert f"expected 0 <= lookahead <= {lookahead}" in str(err)
                pipeline = LookaheadTrainPipeline(dmp, dense, torch.device("cpu"), log_every=10)
            it = iter(batches)
            while True:
                try:
                    _, out, _ = pipeline.progress(it)
                except StopIteration:
                    break
                logits.append(out)
        stats = cache_stats(dmp)
        if name == "pipeline":
            total = pipeline.stats()["total"]
            assert total["trained_batches"] == steps
            assert total["critical_misses"] == 0 and total["wait_s"] >= 0
            assert total["loads"] == sum(s.loads for s in stats.values())
            assert 0 < total["staging_s"] < total["step_s"] or not stats  # no cache here
        runs[name] = {
            "logits": torch.stack(logits),
            "critical": sum(s.critical_misses for s in stats.values()),
            "loads": sum(s.loads for s in stats.values()),
            "evictions": sum(s.evictions for s in stats.values()),
            "weights": local_shards(dmp),
        }
    return runs


def semi_sync_refused(rank: int, world: int) -> str:
    """TorchRec's `TrainPipelineSemiSync` from its first batch on: it looks batch i + 1 up
    before batch i's backward, which distcache refuses; returns the error's message."""
    del world
    dmp, dense = _trainable(_model(), "table_wise", CacheConfig(capacity=0.15, lookahead=3))
    batches = iter(_local_batches(rank, 8))
    pipeline = CpuSemiSyncPipeline(dmp, dense, start_batch=0)
    try:
        for _ in range(8):
            pipeline.progress(batches)
    except LookaheadWindowError as err:
        return str(err)
    raise AssertionError("TrainPipelineSemiSync trained 8 batches over distcache's caches")


def between_steps(rank: int, world: int, kind: str, steps: int = 14) -> dict:
    """The plain loop and `LookaheadTrainPipeline`, each, after the same steps (the pipeline's
    window full of batches routed and staged ahead), evaluating (eval mode, no gradient)
    other batches and once the next training batch itself, and loading the model's state
    saved after step 3 (`load_state_dict`: the caches are purged, the host rows replaced):
    per loop its training logits, its evaluations' logits, its local shards and its caches'
    critical misses."""
    torch.manual_seed(0)
    base = _model()
    state = copy.deepcopy(base.state_dict())
    batches = _local_batches(rank, steps)
    others = _local_batches(rank + world, 3)  # another rank's seed: other batches
    evaluate = {2: others[0], 5: batches[6], 9: others[1], 10: others[2]}
    save, load = 3, 7
    capacity = {"table_wise": 0.15, "row_wise": 0.08}[kind]
    config = CacheConfig(capacity=capacity, lookahead=3, prefetch_depth=2)
    runs = {}
    for name in ("plain", "pipeline"):
        dmp, dense = _trainable(copy.deepcopy(base), kind, config)
        copy_global_into(dmp, state)
        pipeline = LookaheadTrainPipeline(dmp, dense, "cpu") if name == "pipeline" else None
        it = iter(batches)
        logits, evaluations, saved = [], [], None
        for step in range(steps):
            if pipeline is None:
                loss, (_, out, _) = dmp(next(it))
                dense.zero_grad()
                loss.backward()
                dense.step()
            else:
                _, out, _ = pipeline.progress(it)
            logits.append(out)
            if step in evaluate:
                evaluations.append(evaluated(dmp, evaluate[step])[1][1])
            if step == save:
                saved = copy.deepcopy(dmp.state_dict())
            if step == load:
                dmp.load_state_dict(saved)
        runs[name] = {
            "logits": torch.stack(logits),
            "evaluated": evaluations,
            "critical": sum(s.critical_misses for s in cache_stats(dmp).values()),
            "weights": local_shards(dmp),
        }
    return runs
