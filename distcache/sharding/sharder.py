"""distcache's sharders: pass them to `DistributedModelParallel` to cache tables.
`CachedEmbeddingBagCollectionSharder` shards `EmbeddingBagCollection`s (pooled lookups),
`CachedEmbeddingCollectionSharder` `EmbeddingCollection`s (per-id lookups, sequence features).

Example::

    config = CacheConfig(capacity=0.02)
    sharders = [
        CachedEmbeddingBagCollectionSharder(config),
        CachedEmbeddingCollectionSharder(config),
    ]
    plan = CachedShardingPlanner(topology, batch_size=512).collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, plan=plan, sharders=sharders, env=env)

(`CachedShardingPlanner` is TorchRec's `EmbeddingShardingPlanner` with estimators that know the
cached kernel; TorchRec's default estimators refuse it.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_sharding import CACHE_LOAD_FACTOR_STR
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from distcache.cache.config import CacheConfig
from distcache.errors import DistcacheConfigError
from distcache.sharding.parameter_sharding import CACHED_KERNEL, with_cache_config
from distcache.sharding.sharded_module import (
    ShardedCachedEmbeddingBagCollection,
    ShardedCachedEmbeddingCollection,
)

# Row-wise sharding works on CPU with gloo; TorchRec offers it only on CUDA.
_CPU_EXTRA = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]


class _CachedSharder:
    """The cache settings of a distcache sharder and the kernels it offers (mixed in before
    TorchRec's sharder)."""

    def __init__(
        self,
        cache_config: CacheConfig | None = None,
        table_configs: dict[str, CacheConfig] | None = None,
        fused_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(fused_params=fused_params, **kwargs)  # type: ignore[call-arg]
        self.cache_config = _sized_by_load_factor(cache_config or CacheConfig(), fused_params)
        self.table_configs = dict(table_configs or {})
        for name, config in self.table_configs.items():
            if not isinstance(config, CacheConfig):
                raise DistcacheConfigError(
                    f"table_configs[{name!r}] is a {type(config).__name__}: expected CacheConfig"
                )

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return super().compute_kernels(sharding_type, compute_device_type)  # type: ignore[misc]
        return [CACHED_KERNEL]

    def config_for(self, table_name: str) -> CacheConfig:
        return self.table_configs.get(table_name, self.cache_config)

    def _with_configs(self, params: dict[str, ParameterSharding]) -> dict[str, ParameterSharding]:
        """The module's plan with each cached table's `CacheConfig` attached."""
        unknown = sorted(set(self.table_configs) - set(params))
        if unknown:
            raise DistcacheConfigError(
                f"table_configs name tables {unknown} that this module does not shard; its "
                f"tables are {sorted(params)}"
            )
        return {
            name: with_cache_config(p, self.config_for(name), repr(name))
            for name, p in params.items()
        }


def _sized_by_load_factor(config: CacheConfig, fused_params: dict[str, Any] | None) -> CacheConfig:
    """`config` sized by the fused params' `cache_load_factor`, TorchRec's cache size (its UVM
    cache's `fused_params={"cache_load_factor": f}`), where they give one: it would otherwise be
    overwritten by the config's capacity (every row, by default). A capacity of the config's own
    that differs from it is refused in one line, as ambiguous.

    Raises:
        DistcacheConfigError: a load factor outside (0, 1], or beside another capacity."""
    factor = (fused_params or {}).get(CACHE_LOAD_FACTOR_STR)
    if factor is None:
        return config
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise DistcacheConfigError(
            f"fused param {CACHE_LOAD_FACTOR_STR}={factor!r} is invalid: expected the fraction "
            "of each table's rows its cache holds, in (0, 1]"
        )
    default = isinstance(config.capacity, float) and config.capacity == 1.0
    if not default and config.capacity != factor:
        raise DistcacheConfigError(
            f"fused param {CACHE_LOAD_FACTOR_STR}={factor} and CacheConfig.capacity="
            f"{config.capacity} both size the caches: give one of them"
        )
    return dataclasses.replace(config, capacity=float(factor))


class CachedEmbeddingBagCollectionSharder(_CachedSharder, EmbeddingBagCollectionSharder):
    """Shards `EmbeddingBagCollection`s with tables in host memory behind look-ahead caches.

    Offers TorchRec's `customized_kernel` for table-, row-, column-, table-row- and
    table-column-wise sharding, on CPU as on CUDA; data-parallel tables stay TorchRec's dense
    ones. Each cached table's `CacheConfig` travels in the plan (`CachedParameterSharding`).

    Args:
        cache_config: the default for every cached table.
        table_configs: per-table overrides `{table_name: CacheConfig}`.
        fused_params: TorchRec fused params (e.g. `optimizer`, `learning_rate`); parameters'
            `apply_optimizer_in_backward` settings take precedence, as in TorchRec. Their
            `cache_load_factor` (TorchRec's UVM cache size) is `cache_config`'s capacity.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if compute_device_type == "cpu":
            types += [t for t in _CPU_EXTRA if t not in types]
        return types

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedCachedEmbeddingBagCollection:
        sharded = ShardedCachedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=self._with_configs(params),
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        sharded.check_ids = self.cache_config.check_ids
        sharded.fused_ids = self.cache_config.fused_on(torch.device(device or "cpu"))
        sharded.setup_hot_rows()
        return sharded

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection


class CachedEmbeddingCollectionSharder(_CachedSharder, EmbeddingCollectionSharder):
    """Shards `EmbeddingCollection`s (per-id embeddings of sequence features) with tables in
    host memory behind look-ahead caches.

    Offers TorchRec's `customized_kernel` for the sharding types TorchRec offers an
    `EmbeddingCollection`: table-, row- and column-wise; data-parallel tables stay TorchRec's
    dense ones. Arguments as `CachedEmbeddingBagCollectionSharder`.
    """

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedCachedEmbeddingCollection:
        params = self._with_configs(params)
        sharded = ShardedCachedEmbeddingCollection(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        sharded.check_ids = self.cache_config.check_ids
        sharded.fused_ids = self.cache_config.fused_on(torch.device(device or "cpu"))
        # TorchRec's sharded EC keeps no sharding infos (the tables' fused params): rebuilt.
        infos = ShardedCachedEmbeddingCollection.create_grouped_sharding_infos(
            module, params, self.fused_params
        )
        sharded.setup_hot_rows(infos)
        return sharded

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingCollection
