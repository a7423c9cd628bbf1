"""DLRM models for benchmarks, tests and training jobs: build, plan, shard.

One function per step, each usable alone:

    build_dlrm               a TorchRec `DLRMTrain` with one feature per table
    apply_embedding_optimizer  TorchRec's fused optimizer in backward on its embedding tables
    small_tables             the tables whose cache could not hold the batches in flight
    cached_sharder           distcache's sharder, small tables cached whole (`whole_tables`)
    sharding_plan            a hand plan: table-wise round-robin or row-wise over all ranks,
                             optionally small tables resident in TorchRec's kernel
    shard_dlrm               the model under `DistributedModelParallel`
    dense_optimizer          the optimizer of the parameters not updated in backward
    host_embedding_dlrm      tables in host memory (TorchRec's CPU kernel), MLPs on a device

Naming: table i is `t{i}` and is looked up by feature `f{i}`; batches are TorchRec `Batch`es
(`dense_features [B, dense_in_features]`, `sparse_features` a KeyedJaggedTensor with keys
f0..f{n-1}, `labels [B]`).

Example::

    config = DLRMConfig(rows=(1000, 50_000, 20), dim=16)
    model = build_dlrm(config)
    apply_embedding_optimizer(model, "rowwise_adagrad", lr=0.05)
    cache = CacheConfig(capacity=0.05, lookahead=8, prefetch_depth=1)
    sharder = cached_sharder(config.rows, cache, world_size=2, batch_size=512)
    dmp = shard_dlrm(model, sharder, sharding="table_wise", device=torch.device("cpu"))
    optimizer = dense_optimizer(dmp, lambda params: torch.optim.Adagrad(params, lr=0.05))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    construct_module_sharding_plan,
    get_default_sharders,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import (
    CacheParams,
    ModuleSharder,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
)
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from distcache.cache.capacity import pinned_batches
from distcache.cache.config import CacheConfig
from distcache.errors import DistcacheConfigError
from distcache.sharding import (
    CACHED_KERNEL,
    EMBEDDING_OPTIMIZERS,
    FUSED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
)

#: TorchRec's kernel for tables larger than device memory: FBGEMM's UVM cache.
UVM_CACHING_KERNEL = EmbeddingComputeKernel.FUSED_UVM_CACHING.value

#: Path of the `EmbeddingBagCollection` inside a `DLRMTrain`.
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
#: Sharding types `sharding_plan` builds.
SHARDINGS = ("table_wise", "row_wise")


def scaled_rows(rows: Sequence[int], scale_down: float, *, minimum: int = 3) -> tuple[int, ...]:
    """Table sizes divided by `scale_down` (rounded, at least `minimum` rows), to fit a machine.

    Example::

        from distcache.planner.workloads import CRITEO_KAGGLE_ROWS

        scaled_rows(CRITEO_KAGGLE_ROWS, 50)  # the largest table: 202,625 rows
    """
    if not scale_down > 0:
        raise DistcacheConfigError(f"scale_down={scale_down!r} is invalid: expected > 0")
    return tuple(max(minimum, round(r / scale_down)) for r in rows)


def table_name(i: int) -> str:
    """Name of table i."""
    return f"t{i}"


def feature_name(i: int) -> str:
    """Name of the feature that looks up table i."""
    return f"f{i}"


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """The shape of a DLRM: its tables and its MLPs."""

    rows: tuple[int, ...]
    """Rows of each table (table i is `t{i}`, looked up by feature `f{i}`)."""
    dim: int = 16
    """Embedding width of every table (DLRM's interaction needs one width)."""
    dense_in_features: int = 13
    """Dense (continuous) input features per sample; Criteo has 13."""
    dense_hidden: tuple[int, ...] = (64,)
    """Hidden layers of the bottom MLP; a last layer of width `dim` is appended."""
    over_hidden: tuple[int, ...] = (64,)
    """Hidden layers of the top MLP; a last layer of width 1 (the logit) is appended."""
    data_type: str = "FP32"
    """The tables' TorchRec `DataType` name: 'FP32', 'FP16' or 'BF16'."""
    weighted: bool = False
    """A weighted `EmbeddingBagCollection` (a weight per id scales its row)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "dense_hidden", tuple(self.dense_hidden))
        object.__setattr__(self, "over_hidden", tuple(self.over_hidden))
        if not self.rows:
            raise DistcacheConfigError("DLRMConfig.rows=() is invalid: expected at least 1 table")
        for name, values in (
            ("rows", self.rows),
            ("dense_hidden", self.dense_hidden),
            ("over_hidden", self.over_hidden),
        ):
            if not all(_positive_int(v) for v in values):
                raise DistcacheConfigError(
                    f"DLRMConfig.{name}={values!r} is invalid: expected ints >= 1"
                )
        if self.data_type not in ("FP32", "FP16", "BF16"):
            raise DistcacheConfigError(
                f"DLRMConfig.data_type={self.data_type!r} is invalid: expected 'FP32', 'FP16' "
                "or 'BF16'"
            )
        for name in ("dim", "dense_in_features"):
            if not _positive_int(getattr(self, name)):
                raise DistcacheConfigError(
                    f"DLRMConfig.{name}={getattr(self, name)!r} is invalid: expected an int >= 1"
                )

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    @property
    def feature_names(self) -> list[str]:
        return [feature_name(i) for i in range(self.num_tables)]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def build_dlrm(
    config: DLRMConfig,
    *,
    device: torch.device | None = None,
    table_device: torch.device | None = None,
    seed: int | None = 0,
) -> DLRMTrain:
    """A TorchRec `DLRMTrain` (`model(batch)` returns `(loss, (loss, logits, labels))`).

    Args:
        config: tables and MLP sizes.
        device: where the MLPs are created (default: CPU).
        table_device: where the tables are created (default: `device`); `torch.device("meta")`
            allocates them only when sharded (each rank then holds only its shards).
        seed: seeds the initialization through the global RNG (None: leave it as it stands).
    """
    device = device or torch.device("cpu")
    table_device = table_device or device
    if seed is not None:
        torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=table_name(i),
            num_embeddings=rows,
            embedding_dim=config.dim,
            feature_names=[feature_name(i)],
            data_type=DataType[config.data_type],
        )
        for i, rows in enumerate(config.rows)
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(
            tables=tables, is_weighted=config.weighted, device=table_device
        ),
        dense_in_features=config.dense_in_features,
        dense_arch_layer_sizes=[*config.dense_hidden, config.dim],
        over_arch_layer_sizes=[*config.over_hidden, 1],
        dense_device=device,
    )
    return DLRMTrain(dlrm)


def embedding_bag_collection(model: nn.Module) -> EmbeddingBagCollection:
    """The model's (unsharded) `EmbeddingBagCollection`."""
    found = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    if len(found) != 1:
        raise DistcacheConfigError(
            f"expected one EmbeddingBagCollection in the model, found {len(found)}"
        )
    return found[0]


def apply_embedding_optimizer(model: nn.Module, optimizer: str = "sgd", **kwargs: float) -> None:
    """Update the embedding tables in backward with a fused optimizer, the TorchRec way.

    Sharders read it from the parameters: TorchRec's kernels and distcache's caches alike.

    Args:
        model: holds one `EmbeddingBagCollection` (not yet sharded).
        optimizer: one of `EMBEDDING_OPTIMIZERS`.
        kwargs: the optimizer's arguments, e.g. `lr=0.05`, `eps=1e-8`.
    """
    if optimizer not in EMBEDDING_OPTIMIZERS:
        raise DistcacheConfigError(
            f"embedding optimizer {optimizer!r} is invalid: expected one of "
            f"{sorted(EMBEDDING_OPTIMIZERS)}"
        )
    params = embedding_bag_collection(model).parameters()
    apply_optimizer_in_backward(EMBEDDING_OPTIMIZERS[optimizer], params, kwargs)


def small_tables(
    rows: Sequence[int],
    config: CacheConfig,
    *,
    in_flight_ids: int | Sequence[int],
    sharding: str = "table_wise",
    world_size: int = 1,
) -> list[str]:
    """The tables whose cache could not hold the batches in flight.

    A table's cache must hold every distinct row of the batches pinned at once; at most
    `in_flight_ids` of them, and never more than the shard's rows. A row-wise table is judged
    by its largest shard (as if all its ids fell there). Such tables are cached whole
    (`whole_tables`) or kept in TorchRec's kernel (`sharding_plan(resident_tables=...)`).

    Args:
        rows: rows of each table (table i is `t{i}`).
        config: the default cache.
        in_flight_ids: distinct ids of a table that the rank holding it sees in the batches
            pinned at once, for every table or per table: a bound such as
            `pinned_batches(config) * world_size * batch_size` (table-wise, one id per sample),
            or the largest count measured on the data.
        sharding: one of `SHARDINGS`.
        world_size: ranks a row-wise table is split over.
    """
    _check_sharding(sharding)
    if isinstance(in_flight_ids, int):
        in_flight_ids = [in_flight_ids] * len(rows)
    if len(in_flight_ids) != len(rows):
        raise DistcacheConfigError(
            f"in_flight_ids has {len(in_flight_ids)} entries: expected one per table ({len(rows)})"
        )
    out = []
    for i, (num_rows, ids) in enumerate(zip(rows, in_flight_ids, strict=True)):
        local = math.ceil(num_rows / world_size) if sharding == "row_wise" else num_rows
        if config.capacity_rows(local) < min(local, ids):
            out.append(table_name(i))
    return out


def whole_tables(
    rows: Sequence[int],
    config: CacheConfig,
    *,
    in_flight_ids: int | Sequence[int],
    sharding: str = "table_wise",
    world_size: int = 1,
) -> dict[str, CacheConfig]:
    """Per-table overrides caching whole the `small_tables` (same arguments)."""
    whole = dataclasses.replace(config, capacity=1.0)
    small = small_tables(
        rows, config, in_flight_ids=in_flight_ids, sharding=sharding, world_size=world_size
    )
    return {name: whole for name in small}


def cached_sharder(
    rows: Sequence[int],
    config: CacheConfig,
    *,
    world_size: int,
    batch_size: int,
    ids_per_sample: int = 1,
    sharding: str = "table_wise",
    batches_in_flight: int | None = None,
) -> CachedEmbeddingBagCollectionSharder:
    """distcache's sharder with `config` for every table but those cached whole (`whole_tables`).

    Args:
        rows: rows of each table.
        config: the cache of every table.
        world_size: ranks.
        batch_size: samples per rank and batch.
        ids_per_sample: the most ids a sample holds for one feature.
        sharding: one of `SHARDINGS`; every table's owner sees all ranks' ids of its table.
        batches_in_flight: batches pinned at once (default: `pinned_batches(config)`); pass a
            larger one to give several configs the same tables cached whole.
    """
    pinned = pinned_batches(config) if batches_in_flight is None else batches_in_flight
    in_flight = pinned * world_size * batch_size * ids_per_sample
    overrides = whole_tables(
        rows, config, in_flight_ids=in_flight, sharding=sharding, world_size=world_size
    )
    return CachedEmbeddingBagCollectionSharder(config, overrides)


def sharding_plan(
    ebc: EmbeddingBagCollection,
    sharder: ModuleSharder[nn.Module],
    *,
    sharding: str = "table_wise",
    world_size: int,
    device_type: str = "cpu",
    path: str = EBC_PATH,
    resident_tables: Collection[str] = (),
    uvm_cache: CacheParams | None = None,
) -> ShardingPlan:
    """A hand plan for `ebc`: tables round-robin over the ranks (`table_wise`), or each table
    split over all ranks (`row_wise`). distcache's sharder gets its cached kernel, any other
    sharder TorchRec's fused kernel (or, with `uvm_cache`, its UVM cache).

    Args:
        ebc: the module to shard.
        sharder: `CachedEmbeddingBagCollectionSharder`, or TorchRec's
            `EmbeddingBagCollectionSharder`.
        sharding: one of `SHARDINGS`.
        world_size: ranks.
        device_type: "cpu" or "cuda".
        path: the module's path in the model given to DMP.
        resident_tables: tables kept in TorchRec's fused kernel (every row in device memory)
            under distcache's sharder, e.g. the `small_tables`.
        uvm_cache: TorchRec's sharder only: every table on TorchRec's `fused_uvm_caching`
            kernel (FBGEMM's UVM cache: rows in host memory, `load_factor` of them cached in
            GPU memory; CUDA only), with these cache parameters.
    """
    _check_sharding(sharding)
    cached = isinstance(sharder, CachedEmbeddingBagCollectionSharder)
    if uvm_cache is not None and cached:
        raise DistcacheConfigError(
            "uvm_cache places tables on TorchRec's fused_uvm_caching kernel: it needs "
            "TorchRec's EmbeddingBagCollectionSharder, not distcache's"
        )
    names = list(sharder.shardable_parameters(ebc))
    unknown = sorted(set(resident_tables) - set(names))
    if unknown:
        raise DistcacheConfigError(f"resident_tables {unknown} are not tables of the module")

    def placement(i: int, name: str) -> ParameterShardingGenerator:
        kernel = CACHED_KERNEL if cached and name not in resident_tables else FUSED_KERNEL
        if uvm_cache is not None:
            kernel = UVM_CACHING_KERNEL
        if sharding == "table_wise":
            generate = table_wise(rank=i % world_size, compute_kernel=kernel)
        else:
            generate = row_wise(compute_kernel=kernel)
        if uvm_cache is None:
            return generate

        def with_cache(*args, **kwargs) -> ParameterSharding:  # noqa: ANN002, ANN003
            return dataclasses.replace(generate(*args, **kwargs), cache_params=uvm_cache)

        return with_cache

    per_table = {name: placement(i, name) for i, name in enumerate(names)}
    module_plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=per_table,
        local_size=world_size,
        world_size=world_size,
        device_type=device_type,
        sharder=sharder,
    )
    return ShardingPlan({path: module_plan})


def shard_dlrm(
    model: nn.Module,
    sharder: ModuleSharder[nn.Module] | None = None,
    *,
    sharding: str = "table_wise",
    device: torch.device,
    pg: dist.ProcessGroup | None = None,
    path: str = EBC_PATH,
    init_data_parallel: bool = True,
    resident_tables: Collection[str] = (),
    uvm_cache: CacheParams | None = None,
) -> DistributedModelParallel:
    """`model` under `DistributedModelParallel`, its EBC placed by `sharding_plan`.

    Args:
        model: a `DLRMTrain` (or any model whose EBC sits at `path`).
        sharder: the EBC's sharder (default: TorchRec's `EmbeddingBagCollectionSharder`); the
            other module types keep TorchRec's default sharders.
        sharding: one of `SHARDINGS`.
        device: where the shards and the dense layers live.
        pg: the process group (default: the world).
        path: the EBC's path in `model` ("" when `model` is the EBC).
        init_data_parallel: wrap the dense layers in DDP (TorchRec's default).
        resident_tables, uvm_cache: see `sharding_plan`.
    """
    pg = pg or dist.group.WORLD
    sharder = sharder or EmbeddingBagCollectionSharder()
    ebc = model.get_submodule(path) if path else model
    plan = sharding_plan(
        ebc,
        sharder,
        sharding=sharding,
        world_size=dist.get_world_size(pg),
        device_type=device.type,
        path=path,
        resident_tables=resident_tables,
        uvm_cache=uvm_cache,
    )
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=plan,
        sharders=[*get_default_sharders(), sharder],  # the last sharder of a type wins
        init_data_parallel=init_data_parallel,
    )


def dense_optimizer(
    model: nn.Module, factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
) -> KeyedOptimizerWrapper:
    """The optimizer of the parameters that are not updated in backward (the MLPs).

    Example::

        optimizer = dense_optimizer(dmp, lambda params: torch.optim.SGD(params, lr=0.05))
    """
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), factory
    )


def _check_sharding(sharding: str) -> None:
    if sharding not in SHARDINGS:
        raise DistcacheConfigError(f"sharding={sharding!r} is invalid: expected one of {SHARDINGS}")


class HostEmbeddingDLRMTrain(nn.Module):
    """DLRM whose tables stay in host memory while its MLPs run on `device`.

    The baseline of "embeddings on the CPU": the EBC is sharded by TorchRec on a CPU process
    group with its default fused kernel (FBGEMM's CPU kernel, rows updated in backward); each
    batch's ids are looked up on the host and only the pooled embeddings `[B, F, D]` cross to
    the device (their gradient comes back in backward). Batches stay on the host; `forward`
    moves the dense features and labels. Same contract as `DLRMTrain`.

    Args:
        dlrm: the model (its EBC is not used; `sparse` replaces it).
        sparse: the sharded EBC on the host (`KeyedJaggedTensor -> KeyedTensor`).
        device: where the MLPs run (moved there).
        data_parallel: wrap the MLPs in DDP (several ranks).
    """

    def __init__(
        self, dlrm: DLRM, sparse: nn.Module, device: torch.device, *, data_parallel: bool = False
    ):
        super().__init__()
        self.sparse = sparse
        self.device = device
        dense_arch = dlrm.dense_arch.to(device)
        over_arch = dlrm.over_arch.to(device)
        if data_parallel:
            ids = [device] if device.type == "cuda" else None
            dense_arch = DistributedDataParallel(dense_arch, device_ids=ids)
            over_arch = DistributedDataParallel(over_arch, device_ids=ids)
        self.dense_arch = dense_arch
        self.inter_arch = dlrm.inter_arch.to(device)
        self.over_arch = over_arch
        self.feature_names = list(dlrm.sparse_arch.sparse_feature_names)
        self.dim = dlrm.sparse_arch.D
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(
        self, batch: Batch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        dense = batch.dense_features.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        pooled: KeyedTensor = self.sparse(batch.sparse_features)  # on the host
        per_feature = pooled.to_dict()
        sparse = torch.cat([per_feature[f] for f in self.feature_names], dim=1)
        sparse = sparse.view(-1, len(self.feature_names), self.dim)  # [B, F, D]
        # From pageable host memory the copy waits for the transfer (the next op needs it anyway).
        sparse = sparse.to(self.device, non_blocking=True)
        logits = self.over_arch(self.inter_arch(self.dense_arch(dense), sparse)).squeeze(-1)
        loss = self.loss_fn(logits, labels)
        return loss, (loss.detach(), logits.detach(), labels.detach())


def host_embedding_dlrm(
    model: DLRMTrain,
    *,
    device: torch.device,
    host_pg: dist.ProcessGroup | None = None,
    sharding: str = "table_wise",
) -> HostEmbeddingDLRMTrain:
    """`model` with its EBC sharded by TorchRec on the host and its MLPs on `device`.

    Args:
        model: a `DLRMTrain` whose EBC has its embedding optimizer applied.
        device: where the MLPs run.
        host_pg: a gloo process group over the ranks, for the host-side input and output
            all-to-all (default: the world, which must then be gloo).
        sharding: one of `SHARDINGS`.
    """
    host_pg = host_pg or dist.group.WORLD
    ebc = embedding_bag_collection(model)
    sparse = shard_dlrm(
        ebc,
        EmbeddingBagCollectionSharder(),
        sharding=sharding,
        device=torch.device("cpu"),
        pg=host_pg,
        path="",
        init_data_parallel=False,
    )
    data_parallel = dist.get_world_size(host_pg) > 1
    return HostEmbeddingDLRMTrain(model.model, sparse, device, data_parallel=data_parallel)
