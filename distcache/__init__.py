"""distcache: look-ahead embedding caches and throughput planning for TorchRec."""

from distcache.cache import CacheConfig, CachedEmbeddingBags, CacheStats, TableSpec
from distcache.errors import (
    CacheCapacityError,
    DistcacheConfigError,
    DistcacheError,
    InvalidIdError,
    LookaheadWindowError,
)

__version__ = "0.1.0"

__all__ = [
    "CacheCapacityError",
    "CacheConfig",
    "CacheStats",
    "CachedEmbeddingBags",
    "DistcacheConfigError",
    "DistcacheError",
    "InvalidIdError",
    "LookaheadWindowError",
    "TableSpec",
]
