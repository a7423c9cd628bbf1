"""The single-shard look-ahead cache engine (plain torch, no TorchRec)."""

from distcache.cache.config import OPTIMIZERS, POLICIES, CacheConfig
from distcache.cache.counters import CacheStats
from distcache.cache.engine import CacheEngine
from distcache.cache.module import CachedEmbeddingBags, TableSpec
from distcache.cache.scheduler import Scheduler, StagePlan
from distcache.cache.sequence import CachedEmbeddings

__all__ = [
    "OPTIMIZERS",
    "POLICIES",
    "CacheConfig",
    "CacheEngine",
    "CacheStats",
    "CachedEmbeddingBags",
    "CachedEmbeddings",
    "Scheduler",
    "StagePlan",
    "TableSpec",
]
