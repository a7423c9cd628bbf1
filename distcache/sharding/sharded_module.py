"""`ShardedCachedEmbeddingBagCollection`: TorchRec's sharded EBC with distcache's lookups.

Input and output distribution are TorchRec's, unchanged; only the lookups differ.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.cache.engine import CacheStats
from distcache.cache.ids import check_ids
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
    """A sharded `EmbeddingBagCollection` whose `customized_kernel` tables are cached.

    Ids are validated in `input_dist`, on the rank whose batch holds them and before they are
    routed: an out-of-range or negative id raises `InvalidIdError` there (TorchRec's default
    bounds check would map it to row 0 with a warning).
    """

    check_ids: bool = True

    def input_dist(self, ctx, features):  # noqa: ANN001, ANN201
        if self.check_ids and isinstance(features, KeyedJaggedTensor):
            self._check_feature_ids(features)
        return super().input_dist(ctx, features)

    def _check_feature_ids(self, features: KeyedJaggedTensor) -> None:
        if not hasattr(self, "_rows_of_feature"):
            self._rows_of_feature = {
                f: (c.name, c.num_embeddings)
                for c in self._embedding_bag_configs
                for f in c.feature_names
            }
        keys = features.keys()
        known = [self._rows_of_feature.get(k, (None, torch.iinfo(torch.int64).max)) for k in keys]
        rows = torch.tensor([r for _, r in known], device=features.values().device)
        per_key = torch.tensor(features.length_per_key(), device=rows.device)
        feature_of_id = torch.repeat_interleave(
            torch.arange(len(keys), device=rows.device),
            per_key,
            output_size=features.values().numel(),
        )

        def describe(k: int) -> str:
            return f"table {known[k][0]!r} (feature {keys[k]!r}, rank {dist.get_rank()})"

        check_ids(features.values(), feature_of_id, rows, describe)

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

    def stage_ahead(self) -> None:
        """Stage enqueued batches' rows up to each cache's `prefetch_depth` batches ahead."""
        for kernel in self.cached_kernels():
            kernel.bags.prefetch()

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
