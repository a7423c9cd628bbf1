"""The single-shard look-ahead cache engine (plain torch, no TorchRec).

`CacheConfig` and the constants import without torch (the planner's commands use them); the
engine's classes load torch when first asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from distcache.cache.config import OPTIMIZERS, POLICIES, CacheConfig
from distcache.cache.counters import CacheStats

if TYPE_CHECKING:
    from distcache.cache.engine import CacheEngine
    from distcache.cache.module import CachedEmbeddingBags, TableSpec
    from distcache.cache.plan import StagePlan
    from distcache.cache.scheduler import Scheduler
    from distcache.cache.sequence import CachedEmbeddings

# name -> the module defining it, imported on first use (they import torch)
_LAZY = {
    "CacheEngine": "distcache.cache.engine",
    "CachedEmbeddingBags": "distcache.cache.module",
    "TableSpec": "distcache.cache.module",
    "Scheduler": "distcache.cache.scheduler",
    "StagePlan": "distcache.cache.plan",
    "CachedEmbeddings": "distcache.cache.sequence",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distcache.cache' has no attribute {name!r}")


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
