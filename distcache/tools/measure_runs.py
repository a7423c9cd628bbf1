"""What one rank trains when `distcache.tools.measure` runs a plan: the workload's DLRM sharded
as the plan says, its pipeline and its batches (`build`: distcache's sharder and
`LookaheadTrainPipeline`; `build_torchrec`: TorchRec's kernels and pipeline), each as a `Run`
whose step trains one batch, run as `MeasureOptions` say (`measure` exports them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distcache.cache.counters import COUNTERS
from distcache.errors import DistcacheConfigError
from distcache.planner.types import Plan, Workload

if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.types import ShardingPlan

    from distcache.cache.counters import CacheStats
    from distcache.data.synthetic import SyntheticClickLog
    from distcache.job.dlrm import DLRMConfig
    from distcache.planner.torchrec.export import HotRowIds


@dataclass(frozen=True, kw_only=True)
class MeasureOptions:
    """How long and how each plan is run."""

    steps: int = 20
    """Timed steps per plan."""
    warmup: int = 10
    """Steps per plan before timing (caches fill, allocators settle)."""
    threads: int = 1
    """Torch threads per rank; 1 on a shared machine (more than free cores makes OpenMP spin)."""
    learning_rate: float = 0.05
    seed: int = 0
    timeout_s: float = 600.0
    """Deadline of the whole run; a rank that dies or overruns fails it instead of hanging."""

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("warmup", 0), ("threads", 1), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise DistcacheConfigError(f"MeasureOptions.{name} must be an int >= {low}")
        if not self.timeout_s > 0 or not self.learning_rate >= 0:
            raise DistcacheConfigError("MeasureOptions: timeout_s must be > 0, learning_rate >= 0")


@dataclass
class Run:
    """One plan as one rank trains it: a step (its loss), and the cache counters so far."""

    step: Callable[[], torch.Tensor]
    stats: Callable[[], dict[str, float]]


def dlrm_config(workload: Workload) -> DLRMConfig:
    """The `distcache.job.dlrm.DLRMConfig` of a measurable workload (table i is `t{i}`)."""
    from distcache.job.dlrm import DLRMConfig

    return DLRMConfig(
        rows=tuple(t.rows for t in workload.tables),
        dim=workload.tables[0].dim,
        dense_in_features=workload.dense_in_features,
        dense_hidden=tuple(workload.bottom_mlp[:-1]),
        over_hidden=tuple(workload.top_mlp[:-1]),
    )


def _renamed(plan: Plan, workload: Workload) -> tuple[Plan, Workload]:
    """Plan and workload with table i named `t{i}`, as `build_dlrm` names it."""
    from distcache.job.dlrm import table_name

    names = {t.name: table_name(i) for i, t in enumerate(workload.tables)}
    tables = tuple(dataclasses.replace(t, name=names[t.name]) for t in workload.tables)
    placed = tuple(dataclasses.replace(t, table=names[t.table]) for t in plan.tables)
    return (
        dataclasses.replace(plan, tables=placed, explanations={}),
        dataclasses.replace(workload, tables=tables),
    )


def build(plan: Plan, workload: Workload, options: MeasureOptions, device: torch.device) -> Run:
    """`plan` through distcache's sharder and `LookaheadTrainPipeline` (see `measure`)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv

    from distcache.cache.config import CacheConfig
    from distcache.job.dlrm import EBC_PATH, apply_embedding_optimizer, build_dlrm, dense_optimizer
    from distcache.pipeline import LookaheadTrainPipeline
    from distcache.planner.torchrec.export import to_sharding_plan
    from distcache.sharding import CachedEmbeddingBagCollectionSharder, cache_stats

    rank, world = dist.get_rank(), dist.get_world_size()
    plan, named = _renamed(plan, workload)
    # Tables on the meta device: each rank allocates only its shards when DMP shards them.
    model = build_dlrm(dlrm_config(workload), table_device=torch.device("meta"), seed=options.seed)
    apply_embedding_optimizer(model, workload.optimizer, lr=options.learning_rate)
    base = CacheConfig(optimizer=workload.optimizer, learning_rate=options.learning_rate)
    sharding_plan = to_sharding_plan(
        plan,
        named,
        module_path=EBC_PATH,
        world_size=world,
        device=device.type,
        base_config=base,
        hot_row_ids=_hot_row_ids(named, options),
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=device,
        plan=sharding_plan,
        sharders=[*get_default_sharders(), CachedEmbeddingBagCollectionSharder(base)],
    )
    make_whole_caches_resident(dmp)
    optimizer = dense_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=options.learning_rate))
    pipeline = LookaheadTrainPipeline(dmp, optimizer, device)
    batches = iter(_batches(workload, options, rank, world, pipeline.lookahead))
    return Run(
        step=lambda: pipeline.progress(batches)[0].detach(),
        stats=lambda: _counters(cache_stats(dmp)),
    )


def build_torchrec(
    plan: Plan,
    theirs: ShardingPlan | None,
    workload: Workload,
    options: MeasureOptions,
    device: torch.device,
) -> Run:
    """`plan` on TorchRec's own kernels and sharders, trained by TorchRec's pipeline: as
    TorchRec's own plan of it (`theirs`) places it, else as `torchrec_runs.from_plan` does."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingEnv

    from distcache.job.dlrm import apply_embedding_optimizer, build_dlrm, dense_optimizer
    from distcache.tools import torchrec_runs

    rank, world = dist.get_rank(), dist.get_world_size()
    renamed, named = _renamed(plan, workload)
    if theirs is None:
        sharding_plan = torchrec_runs.from_plan(
            renamed, named, world_size=world, device=device.type
        )
    else:
        sharding_plan = torchrec_runs.from_torchrec(theirs, workload)
    model = build_dlrm(dlrm_config(workload), table_device=torch.device("meta"), seed=options.seed)
    apply_embedding_optimizer(model, workload.optimizer, lr=options.learning_rate)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=device,
        plan=sharding_plan,
        sharders=torchrec_runs.sharders(device.type),
    )
    optimizer = dense_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=options.learning_rate))
    # On CPU TorchRec's base pipeline runs forward, backward and the optimizer in order, as
    # distcache's does there; on CUDA its sparse-dist pipeline overlaps the next batch's copy
    # and input all-to-all with training.
    pipeline_type = TrainPipelineSparseDist if device.type == "cuda" else TrainPipelineBase
    pipeline = pipeline_type(dmp, optimizer, device)
    batches = iter(_batches(workload, options, rank, world, 0))
    return Run(
        step=lambda: pipeline.progress(batches)[0].detach(),
        stats=lambda: dict.fromkeys(COUNTED, 0.0),
    )


def make_whole_caches_resident(model: torch.nn.Module) -> None:
    """Load every row of each cache as large as its shard (a device-stored table): what the
    plan prices is every row resident, not a cache still filling (under a power law its cold
    misses would last thousands of steps). Partial caches warm up in the warm-up steps."""
    from distcache.sharding import CachedShardedModule

    for module in model.modules():
        if not isinstance(module, CachedShardedModule):
            continue
        for kernel in module.cached_kernels():
            for engine in kernel.bags.engines:
                rows = engine.scheduler.num_rows
                if engine.capacity >= rows:
                    engine.enqueue(torch.arange(rows, device=engine.device))
                    engine.release(engine.lookup_plan())


def _batches(
    workload: Workload, options: MeasureOptions, rank: int, world: int, lookahead: int
) -> list[Batch]:
    """This rank's batches, in host memory: power-law ids, each table's exponent."""
    n = options.warmup + options.steps + lookahead + 2
    log = _log(workload, options, rank, world, n)
    return [log.batch(i) for i in range(n)]


def _log(
    workload: Workload, options: MeasureOptions, rank: int, world: int, n: int = 1
) -> SyntheticClickLog:
    """The synthetic click log of a measured workload (table i is `t{i}`)."""
    from distcache.data.synthetic import SyntheticClickLog, SyntheticConfig

    config = SyntheticConfig(
        table_sizes=tuple(t.rows for t in workload.tables),
        alpha=tuple(float(t.alpha) for t in workload.tables),
        pooling=int(workload.tables[0].pooling_factor),
        dense_features=workload.dense_in_features,
        batch_size=workload.batch_size_per_rank,
        num_batches=n,
        seed=options.seed,
        hash_ids=True,
    )
    return SyntheticClickLog(config, rank=rank, world_size=world)


def _hot_row_ids(workload: Workload, options: MeasureOptions) -> HotRowIds:
    """A table's likeliest rows as the measured log draws them (popularity ranks hashed)."""
    log = _log(workload, options, 0, 1)
    index = {t.name: i for i, t in enumerate(workload.tables)}
    return lambda table, count: log.rows_of_ranks(index[table.name], range(count)).tolist()


# The counters a measurement reports: every one but the batch count and the evictions.
COUNTED = tuple(c for c in COUNTERS if c not in ("batches", "evictions"))


def _counters(stats: Mapping[str, CacheStats]) -> dict[str, float]:
    return {k: float(sum(s.as_dict()[k] for s in stats.values())) for k in COUNTED}
