"""A training job's model and where its tables go.

`build_model` builds the job's DLRM (`[model]`, the data's tables) with its embedding optimizer
(`[cache] optimizer`); `shard_model` puts it under `DistributedModelParallel` with distcache's
sharder, placed by `job_sharding_plan`: the `[plan]` section as a TorchRec `ShardingPlan`,
made by the producer that `[plan] planner` names (`plan_producer` picks it, and only there):

- `table_wise`, `row_wise`: every table so, by hand (`hand_plan`, `dlrm.sharding_plan`);
- `torchrec`: TorchRec's `EmbeddingShardingPlanner` with distcache's kernel priced in, on the
  `[plan] topology` (`torchrec_job_plan`, `torchrec_job_topology`);
- `distcache`: the throughput planner (`distcache.planner.solve`) on the `[plan] topology`,
  for the job's tables and access profiles (Criteo: counted on a sample of rank 0's batches,
  `[plan] sample_batches`); rank 0 plans and sends the plan, and the rows it replicates, to
  the others, so every rank shards alike (`distcache_job_plan`);
- a `.json` file written by `python -m distcache plan`, sent so too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology as TorchRecTopology
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRMTrain

from distcache.cache.capacity import Shortfall, log_shortfalls
from distcache.cache.config import CacheConfig
from distcache.data.sample import TableSample, id_counts
from distcache.data.sources import JobData
from distcache.errors import DistcacheConfigError, DistcacheError
from distcache.job import dlrm
from distcache.job.config import JobConfig, job_topology, plan_topology
from distcache.planner.solver import solve
from distcache.planner.stats import fitted_alpha
from distcache.planner.torchrec.export import to_sharding_plan
from distcache.planner.torchrec.planner import torchrec_topology
from distcache.planner.types import Plan, SolverOptions, TableStats, Workload
from distcache.sharding import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedShardingPlanner,
)
from distcache.sharding.parameter_sharding import attach_cache_configs, hold_batches_in_flight

log = logging.getLogger(__name__)


def job_workload(config: JobConfig, data: JobData) -> Workload:
    """The planner's view of the job: its tables, their access profiles and the MLPs."""
    m = config.model
    return Workload(
        name="job",
        tables=tuple(
            TableStats(
                name=dlrm.table_name(i),
                rows=rows,
                dim=m.embedding_dim,
                pooling_factor=float(data.max_ids_per_sample),
                alpha=alpha,
                row_dtype_bytes=2 if m.embedding_dtype in ("fp16", "bf16") else None,
            )
            for i, (rows, alpha) in enumerate(zip(data.table_sizes, data.alphas, strict=True))
        ),
        batch_size_per_rank=config.data.batch_size,
        dense_in_features=data.dense_features,
        bottom_mlp=tuple(m.bottom_mlp),
        top_mlp=tuple(m.top_mlp),
        optimizer=config.cache.optimizer,
    )


def torchrec_job_topology(
    config: JobConfig, world_size: int, device: torch.device
) -> TorchRecTopology:
    """What TorchRec's planner plans for: `[plan] topology` in TorchRec's terms, or unset,
    TorchRec's default topology of the job's ranks and device."""
    topology = plan_topology(config, world_size)
    if topology is None:
        return TorchRecTopology(world_size=world_size, compute_device=device.type)
    return torchrec_topology(topology)


#: What makes the job's plan for the EBC of its `DLRMTrain`: (config, model, data, sharder,
#: world size, device) -> TorchRec plan.
PlanProducer = Callable[
    [JobConfig, DLRMTrain, JobData, CachedEmbeddingBagCollectionSharder, int, torch.device],
    tuple[ShardingPlan, list[Shortfall]],
]


def plan_producer(planner: str) -> PlanProducer:
    """The producer of the job's plan that `[plan] planner` names: the one place where the job
    turns that string into the function it calls.

    - 'table_wise', 'row_wise': `hand_plan`, every table so;
    - 'torchrec': `torchrec_job_plan`, TorchRec's planner with distcache's kernel priced in;
    - 'distcache' or a plan `.json` file: `distcache_job_plan`, the plan rank 0 solves (or
      reads from the file, `plan_on_rank_zero`) sent to every rank.
    """
    if planner in dlrm.SHARDINGS:
        return hand_plan
    if planner == "torchrec":
        return torchrec_job_plan
    return distcache_job_plan


def job_sharding_plan(
    config: JobConfig,
    model: DLRMTrain,
    data: JobData,
    sharder: CachedEmbeddingBagCollectionSharder,
    world_size: int,
    device: torch.device,
) -> tuple[ShardingPlan, list[Shortfall]]:
    """The job's plan for the EBC of `model` (a `DLRMTrain`), made by the producer that
    `config.plan.planner` names (`plan_producer`), and the tables whose `[cache]` capacity
    could not hold the batches in flight (raised in the plan; the 'distcache' planner sizes
    its caches itself)."""
    produce = plan_producer(config.plan.planner)
    return produce(config, model, data, sharder, world_size, device)


def _ids_in_flight(config: JobConfig, data: JobData, world_size: int) -> dict[str, int]:
    """The most ids of each table one batch brings its shards: input dist sends them every
    rank's."""
    ids = world_size * config.data.batch_size * data.max_ids_per_sample
    return {dlrm.table_name(i): ids for i in range(len(data.table_sizes))}


def hand_plan(
    config: JobConfig,
    model: DLRMTrain,
    data: JobData,
    sharder: CachedEmbeddingBagCollectionSharder,
    world_size: int,
    device: torch.device,
) -> tuple[ShardingPlan, list[Shortfall]]:
    """Every table placed by `[plan] planner`, a sharding of `dlrm.SHARDINGS`
    (`dlrm.sharding_plan`), caches raised where they cannot hold the batches in flight."""
    ebc = dlrm.embedding_bag_collection(model)
    sharding = config.plan.planner
    plan = dlrm.sharding_plan(
        ebc, sharder, sharding=sharding, world_size=world_size, device_type=device.type
    )
    in_flight = _ids_in_flight(config, data, world_size)
    return hold_batches_in_flight(attach_cache_configs(plan, sharder, model), in_flight)


def torchrec_job_plan(
    config: JobConfig,
    model: DLRMTrain,
    data: JobData,
    sharder: CachedEmbeddingBagCollectionSharder,
    world_size: int,
    device: torch.device,
) -> tuple[ShardingPlan, list[Shortfall]]:
    """TorchRec's `EmbeddingShardingPlanner` (distcache's kernel priced in) on the job's
    topology (`torchrec_job_topology`), planned collectively; it raises the caches that
    cannot hold the batches in flight, and says so."""
    topology = torchrec_job_topology(config, world_size, device)
    in_flight = _ids_in_flight(config, data, world_size)
    torchrec_planner = CachedShardingPlanner(
        topology, config.data.batch_size, ids_per_batch=in_flight
    )
    plan = torchrec_planner.collective_plan(model, [sharder], dist.group.WORLD)
    return plan, torchrec_planner.shortfalls


def distcache_job_plan(
    config: JobConfig,
    model: DLRMTrain,
    data: JobData,
    sharder: CachedEmbeddingBagCollectionSharder,
    world_size: int,
    device: torch.device,
) -> tuple[ShardingPlan, list[Shortfall]]:
    """Rank 0's distcache plan (`plan_on_rank_zero`: solved, or read from the plan file), and
    the hot rows it replicates, sent to every rank and exported as TorchRec's plan; a
    `DistcacheError` of rank 0 is raised on every rank, so none waits for a plan."""
    workload = job_workload(config, data)
    box: list[tuple[Plan, dict[str, list[int]]] | DistcacheError | None] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = plan_on_rank_zero(config, data, workload, world_size)
        except DistcacheError as error:  # every rank fails with it, none waits for a plan
            box[0] = error
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], DistcacheError):
        raise box[0]
    plan, hot = box[0]
    # The plan sizes each table's cache (capacity, L, K); the rest of [cache] applies to all.
    planned = CacheConfig()
    base = dataclasses.replace(
        config.cache,
        capacity=planned.capacity,
        lookahead=planned.lookahead,
        prefetch_depth=planned.prefetch_depth,
    )
    planned = to_sharding_plan(
        plan,
        workload,
        module_path=dlrm.EBC_PATH,
        world_size=world_size,
        device=device.type,
        base_config=base,
        hot_row_ids=lambda table, count: hot[table.name][:count],
    )
    return planned, []


def plan_on_rank_zero(
    config: JobConfig, data: JobData, workload: Workload, world_size: int
) -> tuple[Plan, dict[str, list[int]]]:
    """The 'distcache' planner's plan, or the plan file's, and the rows each table with
    `hot_rows` replicates (by name), which the other ranks receive rather than choose."""
    planner = config.plan.planner
    plan = None if planner == "distcache" else Plan.load(Path(planner))
    # The sample prices the planner's tables and names a plan's hot rows: taken for either.
    wanted = plan is None or any(t.hot_rows for t in plan.tables)
    sampled, counts = (wanted and sampled_workload(config, data, workload)) or (None, None)
    if plan is None:
        topology = plan_topology(config, world_size) or job_topology("cpu", world_size)
        # Hot rows only where the data can name its hottest rows (synthetic data, a sample).
        known = sampled is not None or data.hottest_rows(0, 1) is not None
        options = SolverOptions() if known else SolverOptions(hot_row_shares=())
        plan = solve(sampled or workload, topology, options=options)
    for table, why in plan.explanations.items():
        log.info("plan: %s: %s", table, why)
    index = {t.name: i for i, t in enumerate(workload.tables)}
    unknown = sorted(t.table for t in plan.tables if t.table not in index)
    if unknown:
        raise DistcacheConfigError(
            f"the plan places tables {unknown} that the job does not have (its tables: "
            f"t0 .. t{len(index) - 1})"
        )
    hot = {
        t.table: _hot_rows(data, counts, index[t.table], t.table, t.hot_rows)
        for t in plan.tables
        if t.hot_rows
    }
    for name, rows in hot.items():
        log.info("plan: %s replicates %d hot rows on every rank", name, len(rows))
    return plan, hot


def sampled_workload(
    config: JobConfig, data: JobData, workload: Workload
) -> tuple[Workload, list[TableSample]] | None:
    """For Criteo data, the ids of the first `[plan] sample_batches` training batches of this
    rank counted per table (`distcache.data.sample`), and `workload` with each table's power
    law fitted to them (`fitted_alpha`); None for synthetic data (which knows its popularity)
    or without a sample."""
    batches = config.plan.sample_batches
    if config.data.source == "synthetic" or not batches:
        return None
    counts = id_counts(itertools.islice(data.train_batches(), batches), data.table_sizes)
    tables = tuple(
        dataclasses.replace(t, alpha=fitted_alpha(c.rows, c.lookups, c.seen))
        for t, c in zip(workload.tables, counts, strict=True)
    )
    log.info(
        "plan: tables' power laws fitted to %d batches of rank 0: %s",
        batches,
        ", ".join(f"{t.name} {t.alpha:.2f}" for t in tables),
    )
    return dataclasses.replace(workload, tables=tables), counts


def _hot_rows(
    data: JobData, counts: list[TableSample] | None, index: int, name: str, count: int
) -> list[int]:
    """The `count` hottest rows of table `index`, for a plan that replicates them: the
    synthetic data's own, or the sample's most counted (ties by row)."""
    rows = data.hottest_rows(index, count)
    if rows is None and counts is not None:
        seen = counts[index].seen
        if count > seen:
            raise DistcacheConfigError(
                f"the plan replicates {count} hot rows of table {name!r}, but the id sample "
                f"([plan] sample_batches) saw {seen} of its rows; sample more batches or "
                "replicate fewer rows"
            )
        rows = counts[index].hottest(count)
    if rows is None:
        raise DistcacheConfigError(
            f"the plan replicates {count} hot rows of table {name!r}, but {data.config.source} "
            "data cannot name its hottest rows without a sample ([plan] sample_batches = 0); "
            "use a plan without hot_rows, or sample"
        )
    return rows


def describe_placement(
    plan: ShardingPlan,
    sharder: CachedEmbeddingBagCollectionSharder,
    rows: Sequence[int],
    raised: Collection[str] = (),
) -> tuple[list[str], list[str]]:
    """The plan of the job's EBC as a table, one line per table (sharding, ranks, where its rows
    live, cache rows, L and K), and a warning for each table whose cache the planner sized
    instead of the `[cache]` section (`raised`: tables whose cache was raised to hold the
    batches in flight, said already)."""
    module_plan = plan.plan.get(dlrm.EBC_PATH, {})
    lines = [f"{'table':8s} {'sharding':12s} {'ranks':10s} {'rows':>12s} {'storage':38s}"]
    warnings = []
    for i, num_rows in enumerate(rows):
        name = dlrm.table_name(i)
        p = module_plan.get(name)
        if p is None:
            continue
        ranks = ",".join(map(str, p.ranks or [])) or "all"
        storage = f"device ({p.compute_kernel})"
        if p.compute_kernel == CACHED_KERNEL:
            cache = getattr(p, "cache_config", None) or sharder.config_for(name)
            cached = cache.capacity_rows(num_rows)
            whole = " (whole)" if cached == num_rows else ""
            storage = (
                f"host + cache of {cached:,} rows ({cached / num_rows:.1%}){whole}, "
                f"L={cache.lookahead} K={cache.prefetch_depth}"
            )
            if cache != sharder.cache_config and name not in raised:
                warnings.append(
                    f"{name}: cache sized by the plan, not by [cache] (capacity {cache.capacity})"
                )
        lines.append(f"{name:8s} {p.sharding_type:12s} {ranks:10s} {num_rows:12,d} {storage}")
    return lines, warnings


def build_model(config: JobConfig, data: JobData) -> DLRMTrain:
    """The job's DLRM for the data's tables, its embedding optimizer applied (seed
    `[data] seed`)."""
    m = config.model
    model = dlrm.build_dlrm(
        dlrm.DLRMConfig(
            rows=data.table_sizes,
            dim=m.embedding_dim,
            dense_in_features=data.dense_features,
            dense_hidden=tuple(m.bottom_mlp[:-1]),
            over_hidden=tuple(m.top_mlp[:-1]),
            data_type=m.embedding_dtype.upper(),
            weighted=config.data.weighted,
        ),
        seed=config.data.seed,
    )
    dlrm.apply_embedding_optimizer(model, config.cache.optimizer, lr=config.cache.learning_rate)
    return model


def shard_model(
    config: JobConfig, model: DLRMTrain, data: JobData, world_size: int, device: torch.device
) -> DistributedModelParallel:
    """The model under DMP, placed by the configured planner (`job_sharding_plan`)."""
    sharder = CachedEmbeddingBagCollectionSharder(config.cache)
    plan, raised = job_sharding_plan(config, model, data, sharder, world_size, device)
    if dist.get_rank() == 0:
        if config.plan.planner != "torchrec":  # whose planner says it
            log_shortfalls(raised, "placement")
        names = {s.table for s in raised}
        lines, warnings = describe_placement(plan, sharder, data.table_sizes, names)
        log.info("placement (planner %s):\n%s", config.plan.planner, "\n".join(lines))
        for warning in warnings:
            log.warning("placement: %s", warning)
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=device,
        plan=plan,
        sharders=[sharder],
    )
