"""distcache's TorchRec compute kernels for one group of a rank's table shards: pooled
(`CachedEmbeddingBagKernel`, for `EmbeddingBagCollection`s) and per-id (`CachedEmbeddingKernel`,
for `EmbeddingCollection`s).

TorchRec hands the kernel a `KeyedJaggedTensor` whose ids are already routed to this rank and
made shard-local (row-wise shards see `[0, local_rows)`), one key per feature, bags feature
major: the layout of `CachedEmbeddingBags`, which does the work. The kernel adds TorchRec's
contract around it: initialization from the table configs, `prefetch` (a future batch enters
the look-ahead window and is staged), `flush`/`purge`, ShardedTensor state dicts of the host
rows, and a `FusedOptimizerModule` whose learning rate schedulers can change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
)
from torchrec.distributed.composable.table_batched_embedding_slice import (
    TableBatchedEmbeddingSlice,
)
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.cache.config import CacheConfig
from distcache.cache.engine import ROW_DTYPES
from distcache.cache.module import CachedEmbeddingBags, TableSpec
from distcache.cache.sequence import CachedEmbeddings
from distcache.errors import DistcacheConfigError, UnsupportedError
from distcache.sharding.parameter_sharding import CACHE_CAPACITY_KEY, CACHE_CONFIG_KEY
from distcache.sharding.state import host_table, sharded_state, sharded_weight
from distcache.sharding.torchrec_private import kernel_process_group, mark_updated_in_backward

#: distcache's embedding optimizers (`CacheConfig.optimizer`) -> the optimizer classes TorchRec
#: takes from `apply_optimizer_in_backward` (and prices in its planner). TorchRec turns each into
#: a fused optimizer, which `_OPTIMIZERS` maps back to the name. TorchRec's CPU kernel has no
#: Adam; distcache's caches do.
EMBEDDING_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rowwise_adagrad": RowWiseAdagrad,
    "adam": torch.optim.Adam,
}

# TorchRec's fused optimizer names -> distcache's row optimizers.
_OPTIMIZERS = {
    EmbOptimType.SGD: "sgd",
    EmbOptimType.EXACT_SGD: "sgd",
    EmbOptimType.EXACT_ADAGRAD: "adagrad",
    EmbOptimType.ROWWISE_ADAGRAD: "rowwise_adagrad",
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad",
    EmbOptimType.ADAM: "adam",
}


def cache_config_from_fused_params(fused_params: dict[str, Any] | None) -> CacheConfig:
    """The kernel's `CacheConfig`: the plan's (or sharder's) config, with the optimizer and its
    hyper-parameters taken from TorchRec's fused params (`apply_optimizer_in_backward` kwargs or
    the sharder's `fused_params`) when they are given, and `stochastic_rounding=False` where
    they say so (True, TorchRec's default, leaves the config's: by default FBGEMM's, stochastic
    on CUDA and to nearest on CPU, whose kernels ignore the param)."""
    params = dict(fused_params or {})
    config = params.get(CACHE_CONFIG_KEY) or CacheConfig()
    capacity = table_capacity(params)  # a table's own, where these are a table's params
    updates: dict[str, Any] = {} if capacity is None else {"capacity": capacity}
    if "optimizer" in params:
        kind = params["optimizer"]
        kind = EmbOptimType(kind) if isinstance(kind, str) else kind
        if kind not in _OPTIMIZERS:
            raise DistcacheConfigError(
                f"fused optimizer {kind} is not supported by distcache's kernel: expected one of "
                f"{sorted(str(k) for k in _OPTIMIZERS)}"
            )
        updates["optimizer"] = _OPTIMIZERS[kind]
    for ours, theirs in (
        ("learning_rate", "learning_rate"),
        ("eps", "eps"),
        ("beta1", "beta1"),
        ("beta2", "beta2"),
    ):
        if theirs in params:
            updates[ours] = float(params[theirs])
    if params.get("stochastic_rounding") is False:  # (True, TorchRec's default: as FBGEMM)
        updates["stochastic_rounding"] = False
    _refuse_unapplied(params)
    return dataclasses.replace(config, **updates)


def _refuse_unapplied(params: dict[str, Any]) -> None:
    """Fused params that would change FBGEMM's update and that distcache's kernel does not
    apply, refused in one line rather than ignored: weight decay where a mode asks for it
    (`weight_decay_mode` other than NONE; FBGEMM's default is NONE, and its CPU kernel then
    applied no decay, whatever `weight_decay` said), and gradient clipping."""
    mode = params.get("weight_decay_mode")
    mode_name = getattr(mode, "name", str(mode))
    if mode is not None and mode_name != "NONE" and float(params.get("weight_decay", 0.0)):
        raise DistcacheConfigError(
            f"fused params weight_decay={params.get('weight_decay')} with weight_decay_mode="
            f"{mode_name}: distcache's kernel applies no weight decay; drop them, or keep these "
            "tables on TorchRec's fused kernel"
        )
    if params.get("gradient_clipping"):
        raise DistcacheConfigError(
            "fused param gradient_clipping=True: distcache's kernel does not clip gradients; "
            "drop it, or keep these tables on TorchRec's fused kernel"
        )


def table_capacity(fused_params: dict[str, Any] | None) -> float | int | None:
    """A table's own `CacheConfig.capacity`, from its fused params (`CACHE_CAPACITY_KEY`, set
    beside its config); None in a kernel's, which TorchRec groups without it."""
    params = fused_params or {}
    return params.get(CACHE_CAPACITY_KEY) if CACHE_CONFIG_KEY in params else None


class _CacheOptimizer(FusedOptimizer):
    """The kernel's optimizer as TorchRec sees it.

    Updates happen in backward, so `step` is a no-op. The learning rate in `param_groups` is
    read at every forward, so schedulers work. Parameters and state are ShardedTensors viewing
    the host store (as TorchRec's fused optimizers key them), so `torch.distributed.checkpoint`
    saves and reshards them: flushed before they are read, the caches dropped after a load.
    """

    def __init__(self, kernel: _CachedKernel):
        config = kernel.config
        params: dict[str, torch.Tensor] = {}
        state: dict[Any, Any] = {}
        self._unsupported: list[str] = []
        pg = kernel_process_group(kernel)
        for table in config.embedding_tables:
            weight = sharded_weight(table, kernel.bags.table_weight(table.name), pg)
            params[f"{table.name}.weight"] = weight
            state[weight] = {}
            local = kernel.bags.table_state(table.name)
            if local.shape[1]:
                try:
                    state[weight] = {f"{table.name}.momentum1": sharded_state(table, local, pg)}
                except UnsupportedError as err:  # trains; only checkpointing is refused
                    self._unsupported.append(str(err))
        lr = kernel.cache_config.learning_rate
        super().__init__(params, state, [{"params": list(params.values()), "lr": lr}])
        self._kernel = kernel

    def state_dict(self) -> dict[str, Any]:
        if self._unsupported:
            raise UnsupportedError("; ".join(self._unsupported))
        self._kernel.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self._kernel.purge()

    def step(self, closure: Any = None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass


class _CachedKernel:
    """What distcache's kernels add to TorchRec's: the cached module (`bags`), built from the
    group's shards, its fused optimizer, and TorchRec's state and prefetch contract."""

    bags: CachedEmbeddingBags
    cache_config: CacheConfig
    _config: GroupedEmbeddingConfig
    _pg: dist.ProcessGroup | None
    _feature_table_map: list[int]
    _param_per_table: dict[str, TableBatchedEmbeddingSlice]

    def _build(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        module: type[CachedEmbeddingBags],
        pooling: str,
    ) -> None:
        """Set up the cached module `module` for the group's shards (after TorchRec's own
        kernel `__init__`, which reads the shards' metadata)."""
        # The rows live in host memory whatever device the plan names: describe the shards so.
        config = dataclasses.replace(
            config, embedding_tables=[host_table(t) for t in config.embedding_tables]
        )
        self._config = config
        names = [t.name for t in config.embedding_tables]
        if len(set(names)) != len(names):
            raise UnsupportedError(
                f"distcache's kernel got several shards of one table on one rank ({names}); "
                "plan column-wise shards so that each rank holds at most one shard per table"
            )
        # The group's settings; each table's capacity is its own (`TableSpec.capacity`).
        self.cache_config = cache_config_from_fused_params(config.fused_params)
        # The outputs' dtype, as TorchRec's fused kernel reads it (pooled in fp32, then cast).
        output = (config.fused_params or {}).get("output_dtype")
        self.output_dtype = torch.float32 if output is None else output.as_dtype()
        dtype = data_type_to_dtype(config.data_type)  # TorchRec groups tables by data_type
        if dtype not in ROW_DTYPES:
            raise UnsupportedError(
                f"distcache's kernel stores rows as {ROW_DTYPES}; tables "
                f"{[t.name for t in config.embedding_tables]} have data_type {config.data_type}"
            )
        tables = [
            TableSpec(
                name=t.name,
                num_embeddings=t.local_rows,
                embedding_dim=t.local_cols,
                pooling=pooling,
                dtype=dtype,
                capacity=table_capacity(t.fused_params),
            )
            for t in config.embedding_tables
        ]
        # Ids were validated against the global tables in the sharded module's input_dist,
        # and routing maps valid ids to valid shard-local rows: no second check here.
        self.bags = module(
            tables,
            dataclasses.replace(self.cache_config, check_ids=False),
            device=device or torch.device("cpu"),
            feature_table_map=self._feature_table_map,
        )
        self.init_parameters()  # type: ignore[attr-defined]
        self._param_per_table = {}
        for spec in tables:
            store, lo, hi = self.bags.table_slab(spec.name)
            param = TableBatchedEmbeddingSlice(
                store.weights.view(-1), lo * store.dim, hi * store.dim, hi - lo, store.dim
            )
            mark_updated_in_backward(param)
            self._param_per_table[spec.name] = param
        self._optim = _CacheOptimizer(self)
        # Called after every flush (the host rows are then up to date: more may be written
        # into them, e.g. hot rows) and after every purge (the host rows were just loaded).
        self.flush_hooks: list[Callable[[], None]] = []
        self.purge_hooks: list[Callable[[], None]] = []

    @property
    def emb_module(self) -> CachedEmbeddingBags:
        return self.bags

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def _as_output(self, looked_up: torch.Tensor) -> torch.Tensor:
        """The lookup's fp32 result in the outputs' dtype (`output_dtype`)."""
        if self.output_dtype == torch.float32:
            return looked_up
        return looked_up.to(self.output_dtype)

    def _sync_learning_rate(self) -> None:
        """The optimizer's learning rate, which schedulers may have changed, for this step."""
        lr = float(self._optim.param_groups[0]["lr"])
        for engine in self.bags.engines:
            engine.optimizer.lr = lr

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """A future batch's routed ids enter the look-ahead window; stage rows K batches ahead."""
        self.bags.enqueue(features.values(), features.offsets())
        self.bags.prefetch()

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Each shard's up-to-date host rows `[local_rows, local_cols]` (flushed first)."""
        return [self.bags.table_weight(t.name) for t in self._config.embedding_tables]

    def split_optimizer_states(self) -> list[torch.Tensor]:
        return [self.bags.table_state(t.name) for t in self._config.embedding_tables]

    def named_split_embedding_weights(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for table, weight in zip(
            self._config.embedding_tables, self.split_embedding_weights(), strict=True
        ):
            yield f"{prefix}{table.name}.weight", weight

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        # As TorchRec's fused kernels: the rows are updated in backward, not by a dense optimizer.
        for name, param in self._param_per_table.items():
            yield f"{prefix}{name}.weight", param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()

    def flush(self) -> None:
        self.bags.flush()
        for hook in self.flush_hooks:
            hook()

    def purge(self) -> None:
        """Drop the caches without writing them back, as TorchRec's kernels do before a load:
        `torch.distributed.checkpoint` has just written the host rows in place, and a flush
        would overwrite them. (`state_dict()` flushed before that load read its targets.)"""
        self.bags.reset(flush=False, keep_window=True)
        for hook in self.purge_hooks:
            hook()


class CachedEmbeddingBagKernel(
    _CachedKernel, BaseBatchedEmbeddingBag[torch.Tensor], FusedOptimizerModule
):
    """One group of table shards on one rank, in host memory behind a look-ahead cache:
    pooled lookups (`EmbeddingBagCollection`).

    Args:
        config: TorchRec's grouped config (the shards, their features, pooling, fused params).
        pg: the sharding's process group.
        device: where the cache and lookups live.
        sharding_type: the sharding type of the group.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
    ):
        super().__init__(config, pg, device, sharding_type)
        # TorchRec pools row-wise shards by sum and divides after the reduce-scatter.
        pooling = "mean" if self._pooling == PoolingMode.MEAN else "sum"
        self._build(config, device, CachedEmbeddingBags, pooling)

    def forward(self, features: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Pooled rows of the routed features; weighted features (TorchRec's `is_weighted`
        collections) scale each id's row, and its gradient, by the id's weight."""
        self._sync_learning_rate()
        return self._as_output(
            self.bags(features.values(), features.offsets(), features.weights_or_none())
        )


class CachedEmbeddingKernel(
    _CachedKernel, BaseBatchedEmbedding[torch.Tensor], FusedOptimizerModule
):
    """One group of table shards on one rank, in host memory behind a look-ahead cache:
    per-id lookups (`EmbeddingCollection`), one row per routed id.

    Args:
        config: TorchRec's grouped config (the shards, their features, fused params).
        pg: the sharding's process group.
        device: where the cache and lookups live.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ):
        super().__init__(config, pg, device)
        self._build(config, device, CachedEmbeddings, "sum")

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The rows of the routed ids `[n, local dim]`, in the order of `features.values()`."""
        self._sync_learning_rate()
        return self._as_output(self.bags(features.values(), features.offsets()))
