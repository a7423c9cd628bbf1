"""`CachedGroupedLookup`: TorchRec's pooled lookup, with distcache's kernel for cached tables."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.sharding.kernel import CachedEmbeddingBagKernel


class CachedGroupedLookup(GroupedPooledEmbeddingsLookup):
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
        for kernel, features in zip(
            self._emb_modules, sparse_features.split(self._feature_splits), strict=True
        ):
            if isinstance(kernel, CachedEmbeddingBagKernel):
                kernel.prefetch(features)
