"""distcache: look-ahead embedding caches and throughput planning for TorchRec."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from distcache import quiet
from distcache.cache.config import CacheConfig
from distcache.cache.counters import CacheStats
from distcache.errors import (
    CacheCapacityError,
    CheckpointError,
    DistcacheConfigError,
    DistcacheError,
    InvalidBatchError,
    InvalidIdError,
    LookaheadWindowError,
    NonFiniteError,
    UnknownTableError,
    UnsupportedError,
)

__version__ = "0.1.0"

quiet.install()  # third-party warnings a user cannot act on (TorchRec's, torch's)


if TYPE_CHECKING:
    from distcache.cache.module import CachedEmbeddingBags, TableSpec
    from distcache.cache.sequence import CachedEmbeddings
    from distcache.pipeline import LookaheadTrainPipeline

# Loaded when first asked for: the engine imports torch (a second), the pipeline TorchRec
# (seconds); `python -m distcache plan` needs neither.
_LAZY = {
    "CachedEmbeddingBags": "distcache.cache.module",
    "TableSpec": "distcache.cache.module",
    "CachedEmbeddings": "distcache.cache.sequence",
    "LookaheadTrainPipeline": "distcache.pipeline",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distcache' has no attribute {name!r}")


__all__ = [
    "CacheCapacityError",
    "CacheConfig",
    "CacheStats",
    "CachedEmbeddingBags",
    "CachedEmbeddings",
    "CheckpointError",
    "DistcacheConfigError",
    "DistcacheError",
    "InvalidBatchError",
    "InvalidIdError",
    "LookaheadTrainPipeline",
    "LookaheadWindowError",
    "NonFiniteError",
    "TableSpec",
    "UnknownTableError",
    "UnsupportedError",
]
