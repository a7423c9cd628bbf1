"""distcache as a TorchRec compute kernel: sharder, sharded module, lookup, kernel, plan."""

from distcache.sharding.kernel import EMBEDDING_OPTIMIZERS, CachedEmbeddingBagKernel
from distcache.sharding.lookup import CachedGroupedLookup
from distcache.sharding.plan import (
    CACHED_KERNEL,
    CachedParameterSharding,
    attach_cache_configs,
    with_cache_config,
)
from distcache.sharding.planning import (
    CachedKernelPerfConfig,
    CachedShardingPlanner,
    cached_estimators,
)
from distcache.sharding.sharded_module import ShardedCachedEmbeddingBagCollection, cache_stats
from distcache.sharding.sharder import CachedEmbeddingBagCollectionSharder

__all__ = [
    "CACHED_KERNEL",
    "EMBEDDING_OPTIMIZERS",
    "CachedEmbeddingBagCollectionSharder",
    "CachedEmbeddingBagKernel",
    "CachedGroupedLookup",
    "CachedKernelPerfConfig",
    "CachedParameterSharding",
    "CachedShardingPlanner",
    "ShardedCachedEmbeddingBagCollection",
    "attach_cache_configs",
    "cache_stats",
    "cached_estimators",
    "with_cache_config",
]
