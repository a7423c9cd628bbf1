"""A distcache-sharded collection's hot-row replicas (`CacheConfig.hot_rows`): built from the
plan (`setup_hot_rows`), filled from the shards that hold their rows, and written back to them
when the caches flush or the module's state dict is taken (`hot_shards`; `hot_rows` does
the lookups and the reduction of their gradients)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType

from distcache.errors import UnsupportedError
from distcache.sharding.compact_dist import CompactPooledEmbeddingDist
from distcache.sharding.hot_rows import HotRows
from distcache.sharding.hot_shards import read_replicas, write_replica
from distcache.sharding.kernel import (
    CachedEmbeddingBagKernel,
    CachedEmbeddingKernel,
    cache_config_from_fused_params,
)
from distcache.sharding.parameter_sharding import CACHED_KERNEL, CachedParameterSharding
from distcache.sharding.torchrec_private import (
    emb_dim_per_rank_per_feature,
    kernel_config,
    output_dist_callbacks,
    output_dist_codecs,
    sharding_process_group,
)


class HotRowsSetup:
    """The hot-row part of `CachedShardedModule`, which mixes it in: it reads TorchRec's sharded
    module (its plan, sharding infos, output dists) and `CachedShardedModule`'s
    `_table_configs`, `cached_kernels` and `_lookup_modules`."""

    _hot: HotRows | None = None
    _collection: str  # the TorchRec collection's name, for messages
    module_sharding_plan: dict

    def setup_hot_rows(self, sharding_infos: dict | None = None) -> None:
        """Replicate the hot rows of the tables whose `CacheConfig.hot_rows` name some
        (`distcache.sharding.hot_rows`); all ranks call it (it creates a process group).

        `sharding_infos`: TorchRec's sharding infos by sharding type (every table's, with its
        fused params), where the module does not keep them (`EmbeddingCollection`)."""
        planned = {  # the plan's hot rows and how their gradients are reduced
            name: sharding.cache_config
            for name, sharding in self.module_sharding_plan.items()
            if isinstance(sharding, CachedParameterSharding)
            and sharding.cache_config is not None
            and sharding.cache_config.hot_rows
        }
        if not planned:
            return
        sequence = self._collection == "EmbeddingCollection"
        fused = sorted(
            name
            for name in planned
            if self.module_sharding_plan[name].compute_kernel != CACHED_KERNEL
        )
        if sequence and fused:
            raise UnsupportedError(
                f"hot_rows of EmbeddingCollection tables need distcache's kernel "
                f"({CACHED_KERNEL!r}); tables {fused} are on TorchRec's"
            )
        infos = sharding_infos or self.sharding_type_to_sharding_infos
        # Each table's full settings, its optimizer from TorchRec's fused params included (as
        # its kernel gets them), on every rank: a rank may hold no shard of the table.
        hot = {
            info.embedding_config.name: dataclasses.replace(
                cache_config_from_fused_params(info.fused_params),
                hot_rows=planned[info.embedding_config.name].hot_rows,
                hot_reduce=planned[info.embedding_config.name].hot_reduce,
            )
            for per_type in infos.values()
            for info in per_type
            if info.embedding_config.name in planned
        }
        configs = {c.name: c for c in self._table_configs()}
        self._hot = HotRows(
            {
                name: (configs[name].num_embeddings, configs[name].embedding_dim, c)
                for name, c in hot.items()
            },
            {f: c.name for c in self._table_configs() for f in c.feature_names},
            {
                f
                for c in self._table_configs()
                if getattr(c, "pooling", None) == PoolingType.MEAN
                for f in c.feature_names
            },
            self._device or torch.device("cpu"),
            sequence=sequence,
        )
        self._hot.reader = self._read_hot_rows
        self._hot.lr_sources = dict(self._hot_learning_rates())
        if not sequence:  # per-id outputs send only the cold ids already
            self._compact_output_dists()
        for kernel in self.cached_kernels():
            kernel.flush_hooks.append(lambda k=kernel: self._write_hot_rows(self._hot_shards(k)))
            kernel.purge_hooks.append(self._hot_rows_stale)
        # TorchRec's kernels have no flush of ours: their shards get the replica when the
        # module's state dict is taken (where TorchRec flushes its own caches).
        self.register_state_dict_pre_hook(
            lambda *_: self._write_hot_rows(self._torchrec_hot_shards())
        )
        self.register_load_state_dict_post_hook(lambda module, keys: self._hot_rows_stale())

    def _hot_shards(self, kernel: CachedEmbeddingBagKernel | CachedEmbeddingKernel):  # noqa: ANN202
        """(table, first row, first column, host rows, [host state]) of the kernel's shards of
        hot tables (views of the host store, not flushed)."""
        for table in kernel_config(kernel).embedding_tables:
            if table.name not in self._hot.tables:
                continue
            offsets = table.local_metadata.shard_offsets if table.local_metadata else [0, 0]
            store, lo, hi = kernel.bags.table_slab(table.name)
            yield table.name, offsets[0], offsets[1], store.weights[lo:hi], [store.state[lo:hi]]

    def _compact_output_dists(self) -> None:
        """Table- and column-wise outputs through `CompactPooledEmbeddingDist`: the bags whose
        ids were all hot are not sent (quantized comms keep TorchRec's dist)."""
        for i, (kind, sharding) in enumerate(
            zip(self._sharding_types, self._embedding_shardings, strict=True)
        ):
            old = self._output_dists[i]
            if kind not in (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value):
                continue
            if output_dist_codecs(old) is not None:
                continue
            # A group of its own: its backward all-to-all may run before or after the other
            # shardings' (autograd's order follows each rank's graph), which on one group
            # would pair different collectives across ranks.
            pg = sharding_process_group(sharding)
            group = dist.new_group(
                ranks=dist.get_process_group_ranks(pg), backend=dist.get_backend(pg)
            )
            self._output_dists[i] = CompactPooledEmbeddingDist(
                group,
                sharding.feature_names_per_rank(),
                emb_dim_per_rank_per_feature(sharding),
                old,
                output_dist_callbacks(old),
            )

    def _hot_learning_rates(self):  # noqa: ANN202
        """(table, its learning rate now) for this rank's shards of hot tables: what the
        kernel applies in backward (distcache's: synced from its optimizer's param group each
        forward; FBGEMM's: set from TorchRec's param group at each optimizer step)."""
        for kernel in self._lookup_modules():
            if isinstance(kernel, CachedEmbeddingBagKernel | CachedEmbeddingKernel):
                engines = kernel.bags.engines
                source = lambda e=engines[0]: e.optimizer.lr  # noqa: E731
            elif isinstance(kernel, BaseBatchedEmbeddingBag) and hasattr(
                kernel.emb_module, "get_learning_rate"
            ):
                source = kernel.emb_module.get_learning_rate  # a host tensor's value
            else:
                continue
            for table in kernel.config.embedding_tables:
                if table.name in self._hot.tables:
                    yield table.name, source

    def _torchrec_hot_shards(self):  # noqa: ANN202
        """As `_hot_shards`, for the shards of hot tables in TorchRec's own kernels (FBGEMM's:
        views of its weights and of each optimizer state, `[rows, 1]` for a row-wise one)."""
        for kernel in self._lookup_modules():
            if not isinstance(kernel, BaseBatchedEmbeddingBag) or isinstance(
                kernel, CachedEmbeddingBagKernel
            ):
                continue
            tables = kernel.config.embedding_tables
            if not any(t.name in self._hot.tables for t in tables):
                continue
            weights = kernel.split_embedding_weights()
            states = kernel.emb_module.split_optimizer_states() or [[] for _ in tables]
            for table, weight, state in zip(tables, weights, states, strict=True):
                if table.name not in self._hot.tables:
                    continue
                offsets = table.local_metadata.shard_offsets
                rows = weight.shape[0]
                yield (
                    table.name,
                    offsets[0],
                    offsets[1],
                    weight,
                    [s.view(rows, -1) for s in state],
                )

    def _read_hot_rows(self, hot: HotRows) -> None:
        shards = list(self._torchrec_hot_shards())
        for kernel in self.cached_kernels():
            kernel.bags.flush()  # the host rows up to date before they are read
            shards += list(self._hot_shards(kernel))
        read_replicas(hot, shards)

    def _write_hot_rows(self, shards) -> None:  # noqa: ANN001
        for name, row0, col0, rows, states in shards:
            write_replica(self._hot, name, row0, col0, rows, states)

    def _hot_rows_stale(self) -> None:
        self._hot.stale = True
