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

from typing import Any

import torch
import torch.distributed as dist
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
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ShardingPlan

from distcache.sharding.parameter_sharding import CACHED_KERNEL, attach_cache_configs
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


def cached_estimators(
    topology: Topology, constraints: dict[str, ParameterConstraints] | None = None
) -> list[ShardEstimator]:
    """Perf and storage estimators for `EmbeddingEnumerator(estimator=...)` that know
    distcache's kernel."""
    perf = EmbeddingPerfEstimatorFactory.create_with_config(
        CachedKernelPerfConfig(), topology=topology, constraints=constraints
    )
    return [perf, EmbeddingStorageEstimator(topology=topology, constraints=constraints)]


class CachedShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's `EmbeddingShardingPlanner`, set up for distcache's kernel.

    Args:
        topology: the ranks and their devices (default: the default process group's world
            size, on CUDA if this process has a GPU, else on CPU).
        batch_size: samples per rank per batch, which the estimators price.
        constraints: TorchRec's per-table `ParameterConstraints`.
        **kwargs: the rest of `EmbeddingShardingPlanner`'s arguments (proposer, partitioner,
            storage reservation, ...).

    `plan` and `collective_plan` return TorchRec plans whose distcache tables carry their
    `CacheConfig` (`attach_cache_configs`), so a saved plan reproduces them.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int = 512,
        *,
        constraints: dict[str, ParameterConstraints] | None = None,
        **kwargs: Any,
    ):
        if topology is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            device = "cuda" if torch.cuda.is_available() else "cpu"
            topology = TopologyFactory.create_topology(
                TrainerConfig(world_size=world), kernel_config=KernelConfig(compute_device=device)
            )
        enumerator = EmbeddingEnumerator(
            topology,
            batch_size,
            constraints=constraints,
            estimator=cached_estimators(topology, constraints),
        )
        super().__init__(
            topology=topology,
            batch_size=batch_size,
            enumerator=enumerator,
            constraints=constraints,
            **kwargs,
        )

    def plan(self, module: Any, sharders: list[Any]) -> ShardingPlan:
        return _with_cache_configs(super().plan(module, sharders), sharders, module)

    def collective_plan(self, module: Any, sharders: list[Any], pg: Any = None) -> ShardingPlan:
        plan = super().collective_plan(module, sharders, pg)
        return _with_cache_configs(plan, sharders, module)


def _with_cache_configs(plan: ShardingPlan, sharders: list[Any], module: Any) -> ShardingPlan:
    ours = [
        s
        for s in sharders
        if isinstance(s, (CachedEmbeddingBagCollectionSharder, CachedEmbeddingCollectionSharder))
    ]
    return attach_cache_configs(plan, ours, module) if ours else plan
