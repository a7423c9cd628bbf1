"""Let TorchRec's `EmbeddingShardingPlanner` price and choose distcache's kernel.

TorchRec's perf estimators know no bandwidth for `customized_kernel`: an ordinary
`EmbeddingShardingPlanner` given distcache's sharder fails with TorchRec's "Unrecognized or
unsupported compute kernel: customized_kernel". `CachedShardingPlanner` is that planner set up
for it: its estimators price the cached kernel's lookups at the speed of TorchRec's
device-resident `fused` kernel (the look-ahead window stages every row before its batch is
looked up, so lookups read device memory; a first estimate, which distcache's own throughput
planner replaces), and the plans it returns carry each table's `CacheConfig`.

Example::

    planner = CachedShardingPlanner(batch_size=512)  # world size from the process group
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    ShardEstimator,
    ShardingOption,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import CacheParams, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from distcache.cache.capacity import Shortfall, log_shortfalls, maps_bytes
from distcache.cache.config import CacheConfig
from distcache.sharding.parameter_sharding import (
    CACHED_KERNEL,
    attach_cache_configs,
    hold_batches_in_flight,
    sharder_of,
    sized_by_cache_params,
)
from distcache.sharding.sharder import (
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
)


class CachedKernelPerfConfig(EmbeddingPerfEstimatorConfig):
    """TorchRec's default perf config, with distcache's kernel priced as `fused`."""

    def get_device_bw(self, compute_device: str, compute_kernel: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if compute_kernel == CACHED_KERNEL:
            compute_kernel = EmbeddingComputeKernel.FUSED.value
        return super().get_device_bw(compute_device, compute_kernel, *args, **kwargs)


class CachedStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator, with distcache's kernel priced as what it holds.

    On a GPU a distcache table keeps its rows, with their optimizer state, in host memory, and
    in device memory a cache of its capacity: priced as TorchRec prices its own UVM cache of
    that load factor (`fused_uvm_caching`), plus the cache's maps (`capacity.maps_bytes`).
    TorchRec's estimator alone puts a customized kernel's whole table in device memory, where a
    table larger than the GPU's memory (what distcache is for) fits nowhere. On CPU all of it is
    host memory, as TorchRec prices it.

    Args:
        topology: as TorchRec's.
        constraints: as TorchRec's; a table's `cache_params.load_factor` sizes its cache
            (`sized_by_cache_params`).
        config_for: `(table name, module) -> CacheConfig` of a distcache table (default:
            `CacheConfig()`); `CachedShardingPlanner.plan` sets it from its sharders.
    """

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        config_for: Callable[[str, nn.Module], CacheConfig] | None = None,
    ):
        super().__init__(topology=topology, constraints=constraints)
        self.config_for = config_for or (lambda name, module: CacheConfig())

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: Any) -> None:
        ours = [o for o in sharding_options if o.compute_kernel == CACHED_KERNEL]
        if self._topology.compute_device == "cpu" or not ours:
            return super().estimate(sharding_options, sharder_data_map)
        configs = [self._config(o) for o in ours]
        kept = [(o.compute_kernel, o.cache_params) for o in ours]
        for option, config in zip(ours, configs, strict=True):  # priced as TorchRec's UVM cache
            rows = option.shards[0].size[0]  # (a capacity of N rows is N a shard)
            option.compute_kernel = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
            option.cache_params = dataclasses.replace(
                option.cache_params or CacheParams(), load_factor=config.capacity_rows(rows) / rows
            )
        try:
            super().estimate(sharding_options, sharder_data_map)
        finally:
            for option, (kernel, params) in zip(ours, kept, strict=True):
                option.compute_kernel, option.cache_params = kernel, params
        for option, config in zip(ours, configs, strict=True):  # the cache's maps
            for shard in option.shards:
                rows = shard.size[0]
                maps = maps_bytes(rows, config.capacity_rows(rows), config.is_reactive)
                shard.storage = dataclasses.replace(shard.storage, hbm=shard.storage.hbm + maps)

    def _config(self, option: ShardingOption) -> CacheConfig:
        """The table's `CacheConfig`, sized by its TorchRec load factor where it has one."""
        config = self.config_for(option.name, option.module[1])
        return sized_by_cache_params(config, option.cache_params, repr(option.name))


def cached_estimators(
    topology: Topology,
    constraints: dict[str, ParameterConstraints] | None = None,
    config_for: Callable[[str, nn.Module], CacheConfig] | None = None,
) -> list[ShardEstimator]:
    """Perf and storage estimators for `EmbeddingEnumerator(estimator=...)` that know
    distcache's kernel (`config_for`: as `CachedStorageEstimator`'s)."""
    perf = EmbeddingPerfEstimatorFactory.create_with_config(
        CachedKernelPerfConfig(), topology=topology, constraints=constraints
    )
    return [perf, CachedStorageEstimator(topology, constraints, config_for)]


class CachedShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's `EmbeddingShardingPlanner`, set up for distcache's kernel.

    Args:
        topology: the ranks and their devices (default: the default process group's world
            size, on CUDA if this process has a GPU, else on CPU).
        batch_size: samples per rank per batch, which the estimators price.
        constraints: TorchRec's per-table `ParameterConstraints`.
        ids_per_batch: by table name, the most ids of the table one batch brings its shards
            (all ranks' ids); by default estimated as TorchRec does, the batch size times the
            world size times the pooling factors of the table's features (`constraints`, else
            1 id per sample and feature).
        **kwargs: the rest of `EmbeddingShardingPlanner`'s arguments (proposer, partitioner,
            storage reservation, ...).

    `plan` and `collective_plan` return TorchRec plans whose distcache tables carry their
    `CacheConfig` (`attach_cache_configs`), so a saved plan reproduces them. A cache that
    cannot hold the rows of its batches in flight is raised to one that can, with a warning
    naming the capacity that would have done (`hold_batches_in_flight`), before any batch.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int = 512,
        *,
        constraints: dict[str, ParameterConstraints] | None = None,
        ids_per_batch: Mapping[str, float] | None = None,
        **kwargs: Any,
    ):
        if topology is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            device = "cuda" if torch.cuda.is_available() else "cpu"
            topology = TopologyFactory.create_topology(
                TrainerConfig(world_size=world), kernel_config=KernelConfig(compute_device=device)
            )
        self._ids_per_batch = ids_per_batch
        self._broadcasting = False
        self.shortfalls: list[Shortfall] = []
        """The tables whose cache the last plan raised to hold their batches in flight."""
        self._pooling_constraints = constraints or {}
        self._world_batch = batch_size * topology.world_size
        estimators = cached_estimators(topology, constraints)
        self._storage = estimators[-1]  # (told the sharders' configs by `plan`)
        enumerator = EmbeddingEnumerator(
            topology, batch_size, constraints=constraints, estimator=estimators
        )
        super().__init__(
            topology=topology,
            batch_size=batch_size,
            enumerator=enumerator,
            constraints=constraints,
            **kwargs,
        )

    def plan(self, module: Any, sharders: list[Any]) -> ShardingPlan:
        self._storage.config_for = _config_lookup(sharders)
        plan = super().plan(module, sharders)
        if self._broadcasting:  # rank 0 inside `collective_plan`: every rank finishes it
            return plan
        return self._held(_with_cache_configs(plan, sharders, module), module)

    def collective_plan(self, module: Any, sharders: list[Any], pg: Any = None) -> ShardingPlan:
        # TorchRec's `collective_plan` runs `plan` on rank 0 and sends its result: each rank
        # then attaches the configs and raises short caches alike, so each knows `shortfalls`.
        self._broadcasting = True
        try:
            plan = super().collective_plan(module, sharders, pg)
        finally:
            self._broadcasting = False
        return self._held(_with_cache_configs(plan, sharders, module), module)

    def _held(self, plan: ShardingPlan, module: Any) -> ShardingPlan:
        """`plan` with caches that cannot hold their batches in flight raised, said once."""
        ids = self._ids_per_batch
        if ids is None:
            ids = {
                name: self._world_batch * sum(self._pooling(name, features))
                for name, features in _tables(module).items()
            }
        plan, self.shortfalls = hold_batches_in_flight(plan, ids)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log_shortfalls(self.shortfalls, "CachedShardingPlanner")
        return plan

    def _pooling(self, table: str, features: int) -> list[float]:
        """The pooling factor of each feature of `table` (TorchRec's default: 1.0)."""
        c = self._pooling_constraints.get(table)
        factors = list(c.pooling_factors) if c is not None and c.pooling_factors else []
        return factors if len(factors) == features else [max(factors, default=1.0)] * features


def _tables(module: Any) -> dict[str, int]:
    """The features of each table of the embedding collections in `module`, by table name."""
    out: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, EmbeddingBagCollection):
            out.update({c.name: len(c.feature_names) for c in m.embedding_bag_configs()})
        elif isinstance(m, EmbeddingCollection):
            out.update({c.name: len(c.feature_names) for c in m.embedding_configs()})
    return out


def _ours(sharders: list[Any]) -> list[Any]:
    kinds = (CachedEmbeddingBagCollectionSharder, CachedEmbeddingCollectionSharder)
    return [s for s in sharders if isinstance(s, kinds)]


def _with_cache_configs(plan: ShardingPlan, sharders: list[Any], module: Any) -> ShardingPlan:
    ours = _ours(sharders)
    return attach_cache_configs(plan, ours, module) if ours else plan


def _config_lookup(sharders: list[Any]) -> Callable[[str, nn.Module], CacheConfig]:
    """`(table, module) -> CacheConfig`: the table's config from the distcache sharder of the
    module's type (as `attach_cache_configs` attaches it)."""
    ours = _ours(sharders)

    def config_for(table: str, module: nn.Module) -> CacheConfig:
        return sharder_of(ours, type(module)).config_for(table) if ours else CacheConfig()

    return config_for
