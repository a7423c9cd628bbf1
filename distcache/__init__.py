"""distcache: look-ahead embedding caches and throughput planning for TorchRec."""

from distcache import quiet
from distcache.cache import (
    CacheConfig,
    CachedEmbeddingBags,
    CachedEmbeddings,
    CacheStats,
    TableSpec,
)
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


def __getattr__(name: str):  # noqa: ANN202
    # The pipeline imports TorchRec (seconds): load it when first asked for.
    if name == "LookaheadTrainPipeline":
        from distcache.pipeline import LookaheadTrainPipeline

        return LookaheadTrainPipeline
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
