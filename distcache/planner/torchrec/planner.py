"""TorchRec's own planner on a distcache workload and topology: the baseline plan to beat.

`torchrec_plan` builds the workload's `EmbeddingBagCollection` (and, for its sequence tables,
an `EmbeddingCollection`: `torchrec_module`) on the meta device, maps the topology onto
TorchRec's (`torchrec_topology`), and runs `EmbeddingShardingPlanner.plan` with a sharder per
collection. No process group and no GPU are needed: TorchRec plans a CUDA topology on a CPU
machine.

What TorchRec is told, per table: its pooling factor (`ParameterConstraints.pooling_factors`);
per rank: the workload's batch size, the device and host memory of the topology with no extra
reservation (`FixedPercentageStorageReservation(0)`: distcache's `device_memory_bytes` is already
what embeddings may use), and the workload's optimizer (`apply_optimizer_in_backward` on the
meta module, so that TorchRec counts the optimizer state). TorchRec's cache tables
(`fused_uvm_caching`) get its default cache load factor (0.2) and no access statistics, so it
prices their prefetch at zero.

`TorchRecResult.estimate_s` is TorchRec's own modelled step time of its plan: the rating of its
default perf model (`NoopPerfModel`), i.e. the maximum over ranks of the sum of `Perf.total`
(forward and backward compute and communication, prefetch) of the shards on that rank,
converted from ms to seconds. It leaves out the input all-to-all (`Perf.total` excludes
`input_dist_comms`) and the dense MLPs, so it is not comparable term by term with distcache's
step time; `compare` prices TorchRec's plan with distcache's cost model as well.

`torchrec_estimate` prices any distcache plan that TorchRec can express with the same TorchRec
model: device-resident tables as `fused`, every cache (look-ahead or not) as TorchRec's
`fused_uvm_caching` cache of the same size, which TorchRec prices as a reactive cache (its model
has no look-ahead, so this credits distcache's caches nothing for it).

Example::

    result = torchrec_plan(workload, preset("h100", world_size=8))
    if result.error is None:
        plan = from_sharding_plan(result.plan, workload, world_size=8)
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.perf_models import NoopPerfModel
from torchrec.distributed.planner.stats import NoopEmbeddingStats
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    ParameterConstraints,
    PlannerError,
    ShardingOption,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.planner.types import Topology as TorchRecTopology
from torchrec.distributed.types import CacheParams, ModuleSharder, ShardingPlan, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from distcache.cache.config import CacheConfig
from distcache.errors import DistcacheConfigError
from distcache.planner.torchrec.modules import (
    has_pooled_tables,
    has_sequence_tables,
    torchrec_names,
    workload_ebc,
    workload_ec,
)
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    HOST_CACHED,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Plan,
    TablePlan,
    Topology,
    Workload,
)
from distcache.sharding.kernel import EMBEDDING_OPTIMIZERS
from distcache.sharding.parameter_sharding import attach_cache_configs
from distcache.sharding.planning import cached_estimators
from distcache.sharding.sharder import (
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
)

logger = logging.getLogger(__name__)

SHARDERS = ("default", "distcache")

_MS_PER_S = 1000.0  # TorchRec's bandwidths are bytes/ms, its perf estimates ms


@dataclass(frozen=True, kw_only=True)
class TorchRecResult:
    """What TorchRec's planner made of a workload."""

    plan: ShardingPlan | None
    """TorchRec's plan; None when planning failed."""
    estimate_s: float | None
    """TorchRec's modelled step time of `plan` (see the module docstring); None on failure."""
    planning_s: float
    """Wall-clock seconds TorchRec spent planning (enumeration, proposals, partitioning)."""
    error: str | None = None
    """Why planning failed (e.g. a `PlannerError` when nothing fits), else None."""
    sharders: str = "default"
    """Which sharders TorchRec chose among: one of SHARDERS."""


class _DropDataParallelSpecWarnings(logging.Filter):
    """TorchRec logs "Sharding spec not found" on the root logger for every data-parallel
    table of a plan it validates, which is normal: data-parallel tables have no spec."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Sharding spec not found")


@contextlib.contextmanager
def _quiet_torchrec() -> Iterator[None]:
    root, drop = logging.getLogger(), _DropDataParallelSpecWarnings()
    root.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        root.removeFilter(drop)


def torchrec_topology(topology: Topology) -> TorchRecTopology:
    """TorchRec's `Topology` for ours: same ranks, memory and bandwidths (bytes/s -> bytes/ms).

    On a CPU topology TorchRec keeps tables in DDR, so its DDR capacity and bandwidth are our
    device memory's. On CUDA, DDR is our host memory, and TorchRec's default DDR bandwidth
    stays (only its CPU kernels read it).
    """
    cpu = topology.compute_device == "cpu"
    hardware = HardwareConfig(
        hbm_cap_bytes=None if cpu else topology.device_memory_bytes,
        ddr_cap_bytes=topology.device_memory_bytes if cpu else topology.host_memory_bytes,
        hbm_mem_bw=topology.device_memory_bw_bytes_per_s / _MS_PER_S,
        ddr_mem_bw=topology.device_memory_bw_bytes_per_s / _MS_PER_S if cpu else None,
        hbm_to_ddr_mem_bw=topology.host_to_device_bw_bytes_per_s / _MS_PER_S,
        intra_host_bw=topology.intra_node_bw_bytes_per_s / _MS_PER_S,
        inter_host_bw=topology.inter_node_bw_bytes_per_s / _MS_PER_S,
    )
    trainer = TrainerConfig(
        world_size=topology.world_size,
        local_world_size=min(topology.ranks_per_node, topology.world_size),
    )
    kernel = KernelConfig(compute_device=topology.compute_device, use_hardware_based_bandwidth=True)
    return TopologyFactory.create_topology(
        trainer_config=trainer, hardware_config=hardware, kernel_config=kernel
    )


EBC_CHILD, EC_CHILD = "ebc", "ec"  # `torchrec_module`'s children when it has both


def torchrec_module(workload: Workload) -> torch.nn.Module:
    """The workload's tables on the meta device, its optimizer attached as TorchRec expects:
    its EBC (`workload_ebc`) when every table is pooled, its `EmbeddingCollection`
    (`workload_ec`) when none is, else a module holding both, as children `ebc` and `ec`."""
    parts: dict[str, torch.nn.Module] = {}
    if has_pooled_tables(workload):
        parts[EBC_CHILD] = workload_ebc(workload, device="meta")
    if has_sequence_tables(workload):
        parts[EC_CHILD] = workload_ec(workload, device="meta")
    if len(parts) == 1:
        (module,) = parts.values()
    else:
        module = torch.nn.Module()
        for name, part in parts.items():
            module.add_module(name, part)
    optimizer = EMBEDDING_OPTIMIZERS[workload.optimizer]  # TorchRec counts its state
    apply_optimizer_in_backward(optimizer, module.parameters(), {"lr": 0.01})
    return module


def _sharders(workload: Workload, kind: str) -> list[ModuleSharder]:
    """The sharders of `torchrec_module`'s collections: TorchRec's ("default") or
    distcache's ("distcache", each table given `CacheConfig()` with the workload's optimizer)."""
    config = CacheConfig(optimizer=workload.optimizer)
    bags, sequences = {
        "default": (EmbeddingBagCollectionSharder, EmbeddingCollectionSharder),
        "distcache": (
            lambda: CachedEmbeddingBagCollectionSharder(config),
            lambda: CachedEmbeddingCollectionSharder(config),
        ),
    }[kind]
    out = [bags()] if has_pooled_tables(workload) else []
    return out + ([sequences()] if has_sequence_tables(workload) else [])


def torchrec_constraints(workload: Workload) -> dict[str, ParameterConstraints]:
    """Each table's pooling factor, by its name in TorchRec (`torchrec_names`)."""
    names = torchrec_names(workload)
    return {
        names[t.name]: ParameterConstraints(pooling_factors=[t.pooling_factor])
        for t in workload.tables
    }


def torchrec_plan(
    workload: Workload,
    topology: Topology,
    *,
    sharders: str = "default",
    timeout_s: float | None = None,
) -> TorchRecResult:
    """Run TorchRec's `EmbeddingShardingPlanner` on the workload.

    Args:
        workload: the tables and per-rank batch size.
        topology: the hardware; CUDA topologies are planned without a GPU.
        sharders: "default" (TorchRec's `EmbeddingBagCollectionSharder`, and its
            `EmbeddingCollectionSharder` for sequence tables: their fused, UVM and UVM-caching
            kernels) or "distcache" (distcache's sharders, their kernel priced by
            `cached_estimators` as TorchRec's fused kernel; the plan carries `CacheConfig()`).
        timeout_s: stop proposing after this many seconds and return the best plan so far
            (TorchRec checks it between proposals; enumeration is not interrupted).

    Returns:
        A `TorchRecResult`; planning failures are reported in `error`, not raised.

    Example::

        result = torchrec_plan(workload, topology, timeout_s=60)
    """
    if sharders not in SHARDERS:
        raise DistcacheConfigError(f"sharders must be one of {SHARDERS}, got {sharders!r}")
    trec_topology = torchrec_topology(topology)
    constraints = torchrec_constraints(workload)
    batch_size = workload.batch_size_per_rank
    best: list[list[ShardingOption]] = []
    kwargs = {}
    if sharders == "distcache":
        estimators = cached_estimators(trec_topology, constraints)
        kwargs["enumerator"] = EmbeddingEnumerator(
            trec_topology, batch_size, constraints=constraints, estimator=estimators
        )
    module_sharders = _sharders(workload, sharders)
    planner = EmbeddingShardingPlanner(
        topology=trec_topology,
        batch_size=batch_size,
        storage_reservation=FixedPercentageStorageReservation(0.0),
        stats=[NoopEmbeddingStats()],
        constraints=constraints,
        debug=False,
        callbacks=[lambda options: best.append(options) or options],
        timeout_seconds=None if timeout_s is None else max(1, round(timeout_s)),
        **kwargs,
    )
    module = torchrec_module(workload)
    start = time.perf_counter()
    try:
        with _quiet_torchrec():
            plan = planner.plan(module, module_sharders)
    # TorchRec reports "does not fit" as PlannerError, and an empty search space (e.g. a
    # kernel the device does not offer) as RuntimeError/ValueError/AssertionError.
    except (PlannerError, RuntimeError, ValueError, AssertionError) as err:
        elapsed = time.perf_counter() - start
        logger.info("TorchRec's planner failed after %.1f s: %s", elapsed, err)
        message = f"{type(err).__name__}: {err}"
        return TorchRecResult(
            plan=None, estimate_s=None, planning_s=elapsed, error=message, sharders=sharders
        )
    elapsed = time.perf_counter() - start
    if sharders == "distcache":
        plan = attach_cache_configs(plan, module_sharders, module)
    estimate_ms = NoopPerfModel(trec_topology).rate(best[-1]) if best else None
    return TorchRecResult(
        plan=plan,
        estimate_s=None if estimate_ms is None else estimate_ms / _MS_PER_S,
        planning_s=elapsed,
        sharders=sharders,
    )


def torchrec_estimate(plan: Plan, workload: Workload, topology: Topology) -> float | None:
    """TorchRec's modelled step time (seconds, as `TorchRecResult.estimate_s`) of a distcache
    plan, or None where TorchRec cannot express it: a cache on a CPU topology, row-wise over
    ranks other than all of them, table-row-wise over other than one node's ranks, or
    column-wise shards of unequal width. Caches, look-ahead ones included, are priced as
    TorchRec's `fused_uvm_caching` at the plan's cache fraction.

    Each table is enumerated by TorchRec under constraints that leave exactly the plan's
    sharding type and kernel (`fused`, `dense` for data parallel, `fused_uvm_caching` with the
    plan's cache fraction as load factor), its shards get the plan's ranks, and TorchRec's perf
    model rates the whole.
    """
    trec_topology = torchrec_topology(topology)
    names = torchrec_names(workload)
    ours = {trec: name for name, trec in names.items()}
    constraints = {}
    for table in plan.tables:
        constraint = _constraint(table, workload, topology)
        if constraint is None:
            logger.info("TorchRec cannot express table %r of plan %r", table, plan.name)
            return None
        constraints[names[table.table]] = constraint
    enumerator = EmbeddingEnumerator(
        trec_topology, workload.batch_size_per_rank, constraints=constraints
    )
    try:
        with _quiet_torchrec():
            module = torchrec_module(workload)
            options = enumerator.enumerate(module, _sharders(workload, "default"))
    except (RuntimeError, ValueError, AssertionError) as err:
        logger.info("TorchRec cannot price plan %r: %s", plan.name, err)
        return None
    for option in options:
        table = plan.table(ours[option.name])
        if not _assign_ranks(option, table, trec_topology.local_world_size):
            logger.info(
                "TorchRec's %d shards of %r do not match plan %r: %s",
                len(option.shards),
                option.name,
                plan.name,
                table,
            )
            return None
    return NoopPerfModel(trec_topology).rate(options) / _MS_PER_S


def _constraint(
    table: TablePlan, workload: Workload, topology: Topology
) -> ParameterConstraints | None:
    pooling = [workload.table(table.table).pooling_factor]
    if table.sharding == DATA_PARALLEL:
        return ParameterConstraints(
            sharding_types=[ShardingType.DATA_PARALLEL.value],
            compute_kernels=["dense"],
            pooling_factors=pooling,
        )
    cache = None
    kernel = "fused"
    if table.storage == HOST_CACHED:
        if topology.compute_device != "cuda":  # TorchRec's caches are CUDA-only
            return None
        kernel = "fused_uvm_caching"
        cache = CacheParams(load_factor=table.cache_fraction)
    sharding, min_partition = table.sharding, None
    if topology.compute_device == "cpu" and sharding in (ROW_WISE, TABLE_ROW_WISE):
        return None  # TorchRec's sharders offer neither on CPU (its enumerator warns)
    if table.sharding == ROW_WISE and len(table.ranks) != topology.world_size:
        return None  # TorchRec's row_wise spans every rank
    if table.sharding == TABLE_ROW_WISE and len(table.ranks) > topology.ranks_per_node:
        return None  # a grid: the estimate is not wired for it
    if table.sharding == COLUMN_WISE:
        dim = workload.table(table.table).dim
        if dim % len(table.ranks):
            return None
        min_partition = dim // len(table.ranks)
    return ParameterConstraints(
        sharding_types=[sharding],
        compute_kernels=[kernel],
        pooling_factors=pooling,
        cache_params=cache,
        min_partition=min_partition,
    )


def _assign_ranks(option: ShardingOption, table: TablePlan, local_size: int) -> bool:
    """Put the shards of TorchRec's option on the plan's ranks; False if they do not match."""
    if table.sharding == TABLE_WISE:
        ranks: list[int] = list(table.ranks)
    elif table.sharding in (DATA_PARALLEL, ROW_WISE):
        ranks = list(range(len(option.shards)))
    elif table.sharding == TABLE_ROW_WISE:
        node = min(table.ranks) // local_size
        ranks = list(range(node * local_size, (node + 1) * local_size))
        if sorted(table.ranks) != ranks:
            return False
    else:
        ranks = list(table.ranks)
    if len(ranks) != len(option.shards):
        return False
    for shard, rank in zip(option.shards, ranks, strict=True):
        shard.rank = rank
    return True
