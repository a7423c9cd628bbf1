"""Per-table cache settings carried by the sharding plan.

A `CachedParameterSharding` is TorchRec's `ParameterSharding` plus the table's `CacheConfig`.
TorchRec merges `get_additional_fused_params()` of a customized-kernel table into the fused
params its kernel is built from, so the settings reach the kernel through the plan, and a saved
plan reproduces them. TorchRec gives one kernel to the tables of equal fused params; the
capacity travels apart, under its own cache-size key (`CACHE_CAPACITY_KEY`), which its grouping
leaves out: tables whose configs differ only in capacity (a small table cached whole beside
large ones at 5 %) share one kernel, and per width one cache (`TableSpec.capacity`), as
TorchRec's UVM-cached tables of different load factors share one kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchrec.distributed.embedding_sharding import CACHE_LOAD_FACTOR_STR
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import CacheParams, ParameterSharding, ShardingPlan, ShardingType

from distcache.cache.capacity import Shortfall, shortfall
from distcache.cache.config import CacheConfig
from distcache.constants import HOT_ALL
from distcache.errors import DistcacheConfigError

#: Key of the table's `CacheConfig` in a customized kernel's fused params.
CACHE_CONFIG_KEY = "distcache_cache_config"
#: Key of the table's `CacheConfig.capacity` in its fused params: TorchRec's own cache-size key,
#: which `group_tables` leaves out of the fused params it groups tables by.
CACHE_CAPACITY_KEY = CACHE_LOAD_FACTOR_STR
#: The capacity of the `CacheConfig` that groups tables (each table's is under
#: `CACHE_CAPACITY_KEY`).
GROUPED_CAPACITY = 1.0
#: TorchRec's compute kernel for out-of-tree kernels, which distcache's tables use.
CACHED_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
#: TorchRec's own kernel for device-resident tables (FBGEMM's table-batched embedding).
FUSED_KERNEL = EmbeddingComputeKernel.FUSED.value


@dataclass
class CachedParameterSharding(ParameterSharding):
    """A `ParameterSharding` with a distcache `CacheConfig`: a table in host memory behind a
    distcache cache (`CACHED_KERNEL`), or a table on TorchRec's kernel whose hot rows distcache
    replicates (`CacheConfig.hot_rows`; its other settings are then unused)."""

    cache_config: CacheConfig | None = None

    def get_additional_fused_params(self) -> dict[str, Any]:
        # Without the hot rows and the capacity: TorchRec groups tables of equal fused params
        # into one kernel, and tables replicating different rows, or reducing them differently,
        # or caching more or less of their rows, should still share one (the sharded module
        # reads the hot rows from the plan; the kernel each table's capacity from its own fused
        # params). TorchRec's kernels get none.
        config = self.cache_config
        if config is None or self.compute_kernel != CACHED_KERNEL:
            return {}
        plain = dataclasses.replace(
            config, hot_rows=(), hot_reduce=HOT_ALL, capacity=GROUPED_CAPACITY
        )
        return {CACHE_CONFIG_KEY: plain, CACHE_CAPACITY_KEY: config.capacity}


def with_cache_config(
    sharding: ParameterSharding, config: CacheConfig, table: str = "the table"
) -> ParameterSharding:
    """The same placement with `config` attached, for tables using distcache's kernel (sized by
    the placement's TorchRec `cache_params.load_factor` where it has one: `sized_by_cache_params`),
    and for tables on TorchRec's kernels when `config` replicates hot rows.

    Other tables (data parallel, TorchRec's kernels) are returned unchanged; a table that already
    carries a config keeps it, so a saved plan wins over the sharder's defaults.
    """
    if sharding.compute_kernel != CACHED_KERNEL and (
        not config.hot_rows or sharding.sharding_type == ShardingType.DATA_PARALLEL.value
    ):
        return sharding
    if isinstance(sharding, CachedParameterSharding) and sharding.cache_config is not None:
        return sharding
    if sharding.compute_kernel == CACHED_KERNEL:
        config = sized_by_cache_params(config, sharding.cache_params, table)
    fields = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)}
    return CachedParameterSharding(**fields, cache_config=config)


def sized_by_cache_params(
    config: CacheConfig, cache_params: CacheParams | None, table: str = "the table"
) -> CacheConfig:
    """`config` with TorchRec's per-table cache size, `CacheParams.load_factor`, as its capacity
    where the plan gives one (TorchRec's planner copies it from the table's
    `ParameterConstraints(cache_params=...)`): the fraction of the table's rows its cache holds,
    as TorchRec's own UVM cache reads it.

    Raises:
        DistcacheConfigError: a load factor outside (0, 1], naming `table`."""
    factor = cache_params.load_factor if cache_params is not None else None
    if factor is None:
        return config
    if not 0 < factor <= 1:
        raise DistcacheConfigError(
            f"CacheParams.load_factor={factor} of {table} is invalid: expected the fraction of "
            "its rows cached, in (0, 1]"
        )
    return dataclasses.replace(config, capacity=float(factor))


def attach_cache_configs(plan: ShardingPlan, sharder: Any, module: Any = None) -> ShardingPlan:
    """A copy of `plan` whose distcache tables carry their `CacheConfig`, so that saving the
    plan saves them.

    Args:
        plan: TorchRec's plan.
        sharder: the distcache sharder whose `config_for(table)` gives each table's config, or
            a list of sharders (e.g. one for bags, one for `EmbeddingCollection`s).
        module: the model the plan is for; with several sharders, each module path of the plan
            takes its config from the sharder of the module's type.
    """
    sharders = list(sharder) if isinstance(sharder, (list, tuple)) else [sharder]
    types = {} if module is None else {p: type(m) for p, m in module.named_modules()}
    return ShardingPlan(
        {
            path: type(module_plan)(
                {
                    name: with_cache_config(
                        p, sharder_of(sharders, types.get(path)).config_for(name), repr(name)
                    )
                    for name, p in module_plan.items()
                }
            )
            for path, module_plan in plan.plan.items()
        }
    )


def sharder_of(sharders: Sequence[Any], module_type: type | None) -> Any:
    """The sharder among `sharders` of modules of `module_type` (the first where none is, or
    the type is not known)."""
    for sharder in sharders:
        if module_type is not None and issubclass(module_type, sharder.module_type):
            return sharder
    return sharders[0]


def hold_batches_in_flight(
    plan: ShardingPlan, ids_per_batch: Mapping[str, float]
) -> tuple[ShardingPlan, list[Shortfall]]:
    """`plan` with each distcache table's cache raised where it cannot hold the rows of its
    batches in flight (`distcache.cache.capacity`), and the tables that were; the caller says
    so at warning level (`log_shortfalls`).

    Args:
        plan: a plan whose distcache tables carry their `CacheConfig` (`attach_cache_configs`).
        ids_per_batch: by table name, the most ids of the table that one batch brings the rank
            owning a shard of it (every rank's, since input dist sends a table's ids to its
            shards). Tables left out are not checked. A row-wise shard is judged as if all of
            its table's ids fell in it.
    """
    shortfalls: list[Shortfall] = []
    out: dict[str, Any] = {}
    for path, module_plan in plan.plan.items():
        shardings = {}
        for name, p in module_plan.items():
            config = getattr(p, "cache_config", None)
            rows = _shard_rows(p)
            short = None
            if p.compute_kernel == CACHED_KERNEL and config and rows and name in ids_per_batch:
                short = shortfall(name, config, rows, ids_per_batch[name])
            if short is not None:
                shortfalls.append(short)
                p = dataclasses.replace(p, cache_config=short.raised(config))
            shardings[name] = p
        out[path] = type(module_plan)(shardings)
    return ShardingPlan(out), shortfalls


def _shard_rows(sharding: ParameterSharding) -> int | None:
    """The rows of the largest shard of a placement (None without a sharding spec)."""
    shards = getattr(sharding.sharding_spec, "shards", None)
    return max(s.shard_sizes[0] for s in shards) if shards else None
