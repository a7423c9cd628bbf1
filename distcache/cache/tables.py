"""`TableSpec`: one embedding table of `CachedEmbeddingBags` (its rows, width, pooling, dtype
and, where it is not the config's, its cache), validated when made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from distcache.cache.config import CacheConfig, check_capacity
from distcache.cache.engine import ROW_DTYPES
from distcache.errors import DistcacheConfigError

POOLINGS = ("sum", "mean")


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One embedding table: `num_embeddings` rows of width `embedding_dim`."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: str = "sum"
    """How a bag's rows are combined: 'sum' or 'mean' (an empty bag gives zeros)."""
    dtype: torch.dtype = torch.float32
    """The rows' dtype: float32, or float16 / bfloat16 (half the host memory and the bytes
    staged; pooled in float32, updated in float32 and rounded as
    `CacheConfig.stochastic_rounding` says)."""
    capacity: float | int | None = None
    """The table's cache, as `CacheConfig.capacity` (a fraction of its rows, or rows); None:
    the config's. Its part of the cache its width shares with the other tables."""

    def __post_init__(self) -> None:
        for field in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DistcacheConfigError(
                    f"table {self.name!r}: {field}={value!r} is invalid: expected an int >= 1"
                )
        if self.dtype not in ROW_DTYPES:
            raise DistcacheConfigError(
                f"table {self.name!r}: dtype={self.dtype} is invalid: expected one of {ROW_DTYPES}"
            )
        if self.capacity is not None:
            check_capacity(self.capacity, f"table {self.name!r}: capacity")
        if self.pooling not in POOLINGS:
            raise DistcacheConfigError(
                f"table {self.name!r}: pooling={self.pooling!r} is invalid: expected one of "
                f"{POOLINGS}"
            )


def table_config(table: TableSpec, config: CacheConfig) -> CacheConfig:
    """`config` with `table`'s own capacity, if it has one."""
    if table.capacity is None:  # (1 row is not 1.0 of them: no equality shortcut)
        return config
    return dataclasses.replace(config, capacity=table.capacity)
