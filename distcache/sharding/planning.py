"""Let TorchRec's `EmbeddingShardingPlanner` price and choose distcache's kernel.

TorchRec's perf estimators know no bandwidth for `customized_kernel`. Ours prices its lookups
at the speed of TorchRec's device-resident `fused` kernel: the look-ahead window stages every
row before its batch is looked up, so lookups read device memory. This is a first estimate;
the throughput planner (staging traffic, cache sizes, overlap) replaces it.

Example::

    enumerator = EmbeddingEnumerator(topology, batch_size, estimator=cached_estimators(topology))
    planner = EmbeddingShardingPlanner(topology=topology, enumerator=enumerator)
    plan = planner.plan(model, [CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.02))])
"""

from __future__ import annotations

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardEstimator, Topology

from distcache.sharding.plan import CACHED_KERNEL


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
