"""TorchRec's grouped lookups, with distcache's kernels for cached tables: pooled
(`CachedGroupedLookup`) and per-id (`CachedGroupedSequenceLookup`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import (
    GroupedEmbeddingsLookup,
    GroupedPooledEmbeddingsLookup,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.sharding.kernel import CachedEmbeddingBagKernel, CachedEmbeddingKernel


class _CachedPrefetch:
    """TorchRec's prefetch hook for a grouped lookup (mixed in before it)."""

    _emb_modules: nn.ModuleList
    _feature_splits: list[int]

    def prefetch(
        self,
        sparse_features: KeyedJaggedTensor,
        forward_stream: torch.Stream | None = None,
        ctx: object | None = None,
    ) -> None:
        """Hand a future batch's routed ids to the cached kernels' look-ahead windows."""
        del forward_stream, ctx
        if not self._emb_modules:
            return
        if len(self._emb_modules) == 1:  # (its one split is every feature: no split to make)
            parts = [sparse_features]
        else:
            parts = sparse_features.split(self._feature_splits)
        for kernel, part in zip(self._emb_modules, parts, strict=True):
            if isinstance(kernel, (CachedEmbeddingBagKernel, CachedEmbeddingKernel)):
                kernel.prefetch(part)


class CachedGroupedLookup(_CachedPrefetch, GroupedPooledEmbeddingsLookup):
    """Groups with TorchRec's `customized_kernel` get a `CachedEmbeddingBagKernel`; the others
    keep TorchRec's kernels."""

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return CachedEmbeddingBagKernel(
                config=config, pg=pg, device=device, sharding_type=sharding_type
            )
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class CachedGroupedSequenceLookup(_CachedPrefetch, GroupedEmbeddingsLookup):
    """Groups with TorchRec's `customized_kernel` get a `CachedEmbeddingKernel`; the others
    keep TorchRec's kernels."""

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return CachedEmbeddingKernel(config=config, pg=pg, device=device)
        return super()._create_embedding_kernel(config, pg, device, env)
