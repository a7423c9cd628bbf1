"""distcache as TorchRec compute kernels: sharders, sharded modules, lookups, kernels, plans."""

from distcache.sharding.kernel import (
    EMBEDDING_OPTIMIZERS,
    CachedEmbeddingBagKernel,
    CachedEmbeddingKernel,
)
from distcache.sharding.lookup import CachedGroupedLookup, CachedGroupedSequenceLookup
from distcache.sharding.parameter_sharding import (
    CACHED_KERNEL,
    FUSED_KERNEL,
    CachedParameterSharding,
    attach_cache_configs,
    sized_by_cache_params,
    with_cache_config,
)
from distcache.sharding.planning import (
    CachedKernelPerfConfig,
    CachedShardingPlanner,
    CachedStorageEstimator,
    cached_estimators,
)
from distcache.sharding.sharded_module import (
    CachedShardedModule,
    ShardedCachedEmbeddingBagCollection,
    ShardedCachedEmbeddingCollection,
    cache_stats,
)
from distcache.sharding.sharder import (
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
)

__all__ = [
    "CACHED_KERNEL",
    "FUSED_KERNEL",
    "EMBEDDING_OPTIMIZERS",
    "CachedEmbeddingBagCollectionSharder",
    "CachedEmbeddingBagKernel",
    "CachedEmbeddingCollectionSharder",
    "CachedEmbeddingKernel",
    "CachedGroupedLookup",
    "CachedGroupedSequenceLookup",
    "CachedKernelPerfConfig",
    "CachedParameterSharding",
    "CachedShardedModule",
    "CachedShardingPlanner",
    "CachedStorageEstimator",
    "ShardedCachedEmbeddingBagCollection",
    "ShardedCachedEmbeddingCollection",
    "attach_cache_configs",
    "cache_stats",
    "cached_estimators",
    "sized_by_cache_params",
    "with_cache_config",
]
