"""`ShardedCachedEmbeddingBagCollection`: TorchRec's sharded EBC with distcache's lookups.

Input and output distribution are TorchRec's, unchanged; only the lookups differ.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from distcache.cache.engine import CacheStats
from distcache.sharding.kernel import CachedEmbeddingBagKernel
from distcache.sharding.lookup import CachedGroupedLookup
from distcache.sharding.plan import CACHED_KERNEL

_SHARDING_TYPE = {
    "TwPooledEmbeddingSharding": ShardingType.TABLE_WISE,
    "RwPooledEmbeddingSharding": ShardingType.ROW_WISE,
    "CwPooledEmbeddingSharding": ShardingType.COLUMN_WISE,
    "TwCwPooledEmbeddingSharding": ShardingType.TABLE_COLUMN_WISE,
    "TwRwPooledEmbeddingSharding": ShardingType.TABLE_ROW_WISE,
}


class ShardedCachedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A sharded `EmbeddingBagCollection` whose `customized_kernel` tables are cached."""

    def _create_lookups(self) -> None:
        for sharding in self._embedding_shardings:
            kind = _SHARDING_TYPE.get(type(sharding).__name__)
            if kind is None:  # data parallel: TorchRec's dense lookup, wrapped in DDP later
                self._lookups.append(sharding.create_lookup())
                continue
            configs = (
                sharding._grouped_embedding_configs_per_rank[sharding._rank]
                if isinstance(sharding, TwRwPooledEmbeddingSharding)
                else sharding._grouped_embedding_configs
            )
            self._lookups.append(
                CachedGroupedLookup(
                    grouped_configs=configs,
                    pg=sharding._pg,
                    device=self._device or sharding._device,
                    sharding_type=None if kind == ShardingType.TABLE_WISE else kind,
                    env=sharding._env,
                )
            )

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        # TorchRec skips state-dict plumbing for customized kernels. Ours expose ShardedTensor
        # state dicts and parameters by table exactly as its fused kernels do, so let TorchRec
        # treat them as such while it builds the module's state.
        saved = self.module_sharding_plan
        patched = copy.copy(saved)
        for name, sharding in saved.items():
            if sharding.compute_kernel == CACHED_KERNEL:
                twin = copy.copy(sharding)
                twin.compute_kernel = "fused"
                patched[name] = twin
        self.module_sharding_plan = patched
        try:
            super()._initialize_torch_state(skip_registering)
        finally:
            self.module_sharding_plan = saved

    def cached_kernels(self) -> list[CachedEmbeddingBagKernel]:
        """This rank's distcache kernels (TorchRec keeps lookups in a plain list)."""
        kernels = []
        for lookup in self._lookups:
            while isinstance(lookup, DistributedDataParallel):
                lookup = lookup.module
            kernels += [m for m in lookup.modules() if isinstance(m, CachedEmbeddingBagKernel)]
        return kernels

    def cache_stats(self) -> dict[str, CacheStats]:
        """Cache counters of this rank, per cache (tables of one width in a group share one)."""
        stats = {}
        for kernel in self.cached_kernels():
            stats.update(kernel.bags.stats())
        return stats


def cache_stats(model: nn.Module) -> dict[str, CacheStats]:
    """Cache counters of this rank for every distcache-sharded module of `model` (e.g. a DMP),
    keyed by `module path/tables`."""
    stats = {}
    for path, module in model.named_modules():
        if isinstance(module, ShardedCachedEmbeddingBagCollection):
            for name, s in module.cache_stats().items():
                stats[f"{path}/{name}"] = s
    return stats
