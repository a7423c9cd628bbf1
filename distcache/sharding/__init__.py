"""distcache as a TorchRec compute kernel: sharder, sharded module, lookup, kernel, plan."""

from distcache.sharding.kernel import CachedEmbeddingBagKernel
from distcache.sharding.lookup import CachedGroupedLookup
from distcache.sharding.plan import CACHED_KERNEL, CachedParameterSharding, with_cache_config
from distcache.sharding.sharded_module import ShardedCachedEmbeddingBagCollection, cache_stats
from distcache.sharding.sharder import CachedEmbeddingBagCollectionSharder

__all__ = [
    "CACHED_KERNEL",
    "CachedEmbeddingBagCollectionSharder",
    "CachedEmbeddingBagKernel",
    "CachedGroupedLookup",
    "CachedParameterSharding",
    "ShardedCachedEmbeddingBagCollection",
    "cache_stats",
    "with_cache_config",
]
