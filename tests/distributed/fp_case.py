"""A model sharded on distcache's kernel against the same model on TorchRec's `fused`, for what
TorchRec's kernel defines beyond the rows: TorchRec's `FeatureProcessedEmbeddingBagCollection`
(position-weighted features: each id's weight learned per position in its bag; the FP sharder
around each kernel's EBC sharder) and the sharders' `fused_params={"output_dtype": FP16}`.
Integer rows and SGD with lr 1, so every sum is exact and the two must agree bitwise."""

from __future__ import annotations

import contextlib
import dataclasses
import unittest.mock
from collections.abc import Callable

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import row_wise, table_wise
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from distcache import CacheConfig
from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding import CACHED_KERNEL, CachedEmbeddingBagCollectionSharder, cache_stats
from tests.distributed.sharded_model import (
    FEATURES,
    TABLES,
    copy_global_into,
    evaluated,
    global_batches,
    integer_init,
    local_shards,
    local_slice,
    loss_of,
    make_ebc,
    per_table_plan,
)

# `hot`: distcache's t0 and t3 replicate some of their rows on every rank.
REPLICAS = {"t0": (0, 1, 2), "t3": (1, 0)}


def _ebc_sharder(kernel: str, hot: bool, **kwargs) -> object:  # noqa: ANN003
    """The EBC sharder of `kernel`: TorchRec's, or distcache's (small caches, `hot` rows)."""
    if kernel == "fused":
        return EmbeddingBagCollectionSharder(**kwargs)
    config = CacheConfig(capacity=20, lookahead=2)
    tables = (
        {t: dataclasses.replace(config, hot_rows=r) for t, r in REPLICAS.items()} if hot else {}
    )
    return CachedEmbeddingBagCollectionSharder(config, tables, **kwargs)


class _LossAndOutput(torch.nn.Module):
    """`module`'s output and its loss, as `LookaheadTrainPipeline` calls a model."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.sparse = module

    def forward(self, kjt):  # noqa: ANN001, ANN201
        out = self.sparse(kjt)
        return loss_of(out).float(), out


def _routings_counted(counts: list[int]) -> contextlib.AbstractContextManager:
    """Count, into `counts`, the input all-to-alls TorchRec's sharded EBC starts."""
    routes = ShardedEmbeddingBagCollection.input_dist

    def counted(self, ctx, features):  # noqa: ANN001, ANN201
        counts.append(1)
        return routes(self, ctx, features)

    return unittest.mock.patch.object(ShardedEmbeddingBagCollection, "input_dist", counted)


def on_both_kernels(
    rank: int,
    world: int,
    kind: str,
    build: Callable[[str], tuple[torch.nn.Module, torch.nn.Module, object]],
    steps: int = 6,
    pipelined: bool = False,
) -> dict:
    """Train `build(kernel)`'s (model, its EBC, sharder) on each kernel, `kind`-sharded, from
    the same weights and batches, in a plain loop (`pipelined`: distcache's kernel under
    `LookaheadTrainPipeline`), evaluating another batch half way: per kernel its outputs per
    step and the evaluation's, its tables' local shards, its dense parameters (the position
    weights), its caches' loads and critical-path misses, and the input all-to-alls it
    started."""
    *batches, other = [
        local_slice(b, rank, world) for b in global_batches(steps + 1, 3, world, seed=5)
    ]
    runs, state = {}, None
    for kernel in ("fused", CACHED_KERNEL):
        module, ebc, sharder = build(kernel)
        model = _LossAndOutput(module)
        state = state or model.state_dict()
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
        shard = {
            "table_wise": lambda i, k=kernel: table_wise(rank=i % world, compute_kernel=k),
            "row_wise": lambda i, k=kernel: row_wise(compute_kernel=k),
        }[kind]
        per_table = {name: shard(i) for i, (name, *_) in enumerate(TABLES)}
        dmp = per_table_plan(
            model, "sparse", module, per_table, sharder, kernel, init_data_parallel=False
        )
        copy_global_into(dmp, state)
        dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        optimizer = torch.optim.SGD(dense, lr=1.0) if dense else None
        outputs, routings, evaluations = [], [], []
        pipeline, it = None, iter(batches)
        if pipelined and kernel == CACHED_KERNEL:
            pipeline = LookaheadTrainPipeline(dmp, optimizer, "cpu", sparse_input=lambda b: b)
        with _routings_counted(routings):
            for step in range(steps):
                if pipeline is not None:
                    outputs.append(pipeline.progress(it))
                else:
                    loss, out = dmp(next(it))
                    if optimizer is not None:
                        optimizer.zero_grad()
                    loss.backward()
                    if optimizer is not None:
                        optimizer.step()
                    outputs.append(out)
                if step == steps // 2:  # an evaluation between steps (the window full)
                    evaluations.append(evaluated(dmp, other)[1])
        stats = cache_stats(dmp).values()
        runs[kernel] = {
            "outputs": [{f: t.detach() for f, t in out.to_dict().items()} for out in outputs],
            "evaluated": [{f: t for f, t in out.to_dict().items()} for out in evaluations],
            "tables": local_shards(dmp),
            "dense": {
                k: p.detach().clone()
                for k, p in in_backward_optimizer_filter(dmp.named_parameters())
            },
            "loads": sum(s.loads for s in stats),
            "critical_misses": sum(s.critical_misses for s in stats),
            "routings": len(routings),
        }
    return runs


def fp_trained(
    rank: int, world: int, kind: str, hot: bool = False, pipelined: bool = False
) -> dict:
    """`on_both_kernels` of a weighted EBC behind position weights (the FP sharder around each
    kernel's EBC sharder)."""

    def build(kernel: str) -> tuple[torch.nn.Module, torch.nn.Module, object]:
        ebc = make_ebc(weighted=True)
        integer_init(ebc, 3)
        positions = PositionWeightedModuleCollection(dict.fromkeys(FEATURES, 4))
        model = FeatureProcessedEmbeddingBagCollection(ebc, positions)
        sharder = FeatureProcessedEmbeddingBagCollectionSharder(_ebc_sharder(kernel, hot))
        return model, ebc, sharder

    return on_both_kernels(rank, world, kind, build, pipelined=pipelined)


def half_outputs(rank: int, world: int, kind: str, hot: bool = False) -> dict:
    """`on_both_kernels` of an EBC whose sharders ask for fp16 outputs."""

    def build(kernel: str) -> tuple[torch.nn.Module, torch.nn.Module, object]:
        ebc = make_ebc()
        integer_init(ebc, 4)
        fused_params = {"output_dtype": SparseType.FP16}
        return ebc, ebc, _ebc_sharder(kernel, hot, fused_params=fused_params)

    return on_both_kernels(rank, world, kind, build)
