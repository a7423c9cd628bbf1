"""Run plans for real on this machine: the measured side of `compare --measure` and of
`benchmarks/planner.py`.

A plan of a workload is trained for a few steps on `world_size` local gloo ranks (CPU): the
workload becomes a TorchRec DLRM (`distcache.job.dlrm.build_dlrm`), the plan its `ShardingPlan`
(`export.to_sharding_plan`, distcache's sharder: data-parallel tables keep TorchRec's dense
kernel, every other table distcache's cache, a device-stored table being a cache of every
row, loaded whole before timing), trained by `LookaheadTrainPipeline` on `SyntheticClickLog`
batches whose ids follow each table's power law (`hash_ids`: hot rows spread over the id
space). Every plan of a call trains in the same processes, in turns step by step (the order
rotated every step), each step timed from a barrier, so the machine's drift touches them
alike; a step's time is the slowest rank's, and a plan's is the median over the timed steps
after the warm-up (partial caches fill during it).

A plan named in `torchrec_kernels` runs on TorchRec's own kernels instead (`fused`, its
device-resident kernel, on every sharded table; TorchRec's sharders; trained by TorchRec's
`TrainPipelineBase`, which on CPU runs forward, backward and the optimizer in order, as
distcache's pipeline does here): TorchRec's plan as TorchRec runs it. Such a plan must keep every
table on the device (TorchRec has no cache on CPU).

With `device="cuda"` (`compare --measure --device cuda`) the plans run on one GPU, `cuda:0`, in
this process (one rank, a one-rank NCCL group): distcache's plans through distcache's sharder
and `LookaheadTrainPipeline` on the GPU, TorchRec's on its kernels as its planner chose them
(`torchrec_runs.from_torchrec`: `fused` where the rows fit the device memory,
`fused_uvm_caching` or `fused_uvm` where they do not, host-mapped) under TorchRec's
`TrainPipelineSparseDist`; each step is timed between two `torch.cuda.synchronize`. A CUDA
topology of one rank runs there, when every plan's rows fit this machine's host memory
(`unmeasurable_reason`). This path has not run on a GPU yet: `tests/gpu/test_measure_cuda.py`
and `benchmarks/gpu_session.sh issue35` run it.

The pipeline runs one look-ahead window: every cache at the smallest (L, K) of the plan's
caches (`runnable_plan`). What can be measured (`unmeasurable_reason`): a CPU topology of at
most `MAX_LOCAL_RANKS` ranks, a workload of one embedding dim whose MLPs end as DLRM's do
(bottom MLP at the dim, top MLP of >= 2 layers at 1), one integral pooling factor and
power-law tables (not id counts).

`distcache.tools.framework_costs` times tiny plans with `time_plans_here` to fit what the cost
model cannot derive, on CPU or one GPU (`python -m distcache calibrate` runs it).

Example::

    results = measure_plans({"tw": plan}, workload, world_size=2)
    print(results["tw"].step_s)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

from distcache.errors import DistcacheConfigError
from distcache.job.distributed import run_ranks
from distcache.planner.types import (
    DATA_PARALLEL,
    DEVICE,
    Plan,
    Topology,
    Workload,
)
from distcache.tools.collectives import CollectiveBytes
from distcache.tools.machine import cuda_missing, cuda_topology_reason
from distcache.tools.measure_runs import COUNTED, MeasureOptions, Run, build, build_torchrec

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan


MAX_LOCAL_RANKS = 2
"""Ranks this machine runs at once (2 shared cores: more would time the scheduler)."""


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One plan run on this machine."""

    plan: str
    world_size: int
    step_s: float
    """Median over the timed steps of the slowest rank's step time."""
    step_s_per_step: tuple[float, ...]
    """The slowest rank's time of each timed step."""
    cache: dict[str, float]
    """Cache counters of the timed steps per step, averaged over ranks: ids, unique, hits,
    loads, writebacks; critical_misses summed over the timed steps and ranks."""
    all_to_all_sent_bytes: float = 0.0
    """Bytes a rank sent to other ranks per timed step in the ids' and embeddings'
    collectives (all-to-alls, and the reduce-scatter and all-gather of row-wise outputs),
    forward and backward, averaged over ranks (`CollectiveBytes`)."""
    all_reduce_bytes: float = 0.0
    """Bytes a rank all-reduced per timed step (dense gradients), averaged over ranks."""
    hot_gather_bytes: float = 0.0
    """Bytes a rank sent per timed step in the hot-row replicas' all-gathers of their touched
    rows (`CacheConfig.hot_reduce` 'touched'), averaged over ranks."""

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


DEVICES = ("cpu", "cuda")
"""Where `measure_plans` runs plans: local gloo ranks on CPU, or one rank on one GPU."""


def unmeasurable_reason(
    workload: Workload, topology: Topology, *, device: str = "cpu", plans: int = 1
) -> str | None:
    """Why plans of `workload` on `topology` cannot run here on `device`, or None when they can.

    On CUDA: a CUDA topology of one rank, and `plans` copies of every table's rows (each plan
    keeps its own) within this machine's memory (`machine.cuda_topology_reason`).
    """
    if device not in DEVICES:
        raise DistcacheConfigError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        reason = cuda_topology_reason(workload, topology, plans)
    elif topology.compute_device != "cpu":
        reason = f"topology {topology.name} is a {topology.compute_device} topology; this is a CPU"
    elif topology.world_size > MAX_LOCAL_RANKS:
        reason = (
            f"topology {topology.name} has {topology.world_size} ranks; this machine runs at "
            f"most {MAX_LOCAL_RANKS}"
        )
    else:
        reason = None
    return reason or workload_unmeasurable_reason(workload)


def workload_unmeasurable_reason(workload: Workload) -> str | None:
    """Why `workload` cannot be built as a DLRM and fed synthetic batches, or None."""
    sequence = [t.name for t in workload.tables if not t.pooled]
    if sequence:
        return f"DLRM pools every table; tables {sequence[:5]} are sequence tables (pooled = false)"
    dims = {t.dim for t in workload.tables}
    if len(dims) > 1:
        return f"DLRM needs one embedding dim; workload {workload.name} has {sorted(dims)}"
    dim = dims.pop()
    if not workload.bottom_mlp or workload.bottom_mlp[-1] != dim:
        return f"the bottom MLP {workload.bottom_mlp} must end at the embedding dim {dim}"
    if len(workload.top_mlp) < 2 or workload.top_mlp[-1] != 1:
        return f"the top MLP {workload.top_mlp} must have >= 2 layers, the last of width 1"
    poolings = {t.pooling_factor for t in workload.tables}
    if len(poolings) > 1 or any(p != int(p) for p in poolings):
        return f"the synthetic log draws one integral pooling factor, not {sorted(poolings)}"
    for t in workload.tables:
        if t.counts is not None or t.alpha is None:
            return f"table {t.name}: only power-law tables are generated here, not id counts"
    if workload.dtype_bytes != 4:
        return f"only float32 tables run here, not {workload.dtype_bytes}-byte ones"
    return None


def runnable_plan(plan: Plan) -> Plan:
    """`plan` as the pipeline runs it: every table in one look-ahead window.

    The pipeline routes ahead by the smallest look-ahead of its caches, and a device-stored
    table is a cache of every row (no misses), so device tables take the plan's largest (L, K)
    among its cached tables; the modelled cost does not change (`cost.shard_terms` prices L
    and K for host-cached tables only).
    """
    cached = [t for t in plan.tables if t.storage != DEVICE and t.lookahead > 0]
    if not cached:
        return plan
    lookahead = max(t.lookahead for t in cached)
    depth = max(t.prefetch_depth for t in cached)
    tables = tuple(
        dataclasses.replace(t, lookahead=lookahead, prefetch_depth=depth)
        if t.storage == DEVICE and t.sharding != DATA_PARALLEL
        else t
        for t in plan.tables
    )
    return dataclasses.replace(plan, tables=tables)


def measure_plans(
    plans: dict[str, Plan],
    workload: Workload,
    *,
    world_size: int,
    options: MeasureOptions | None = None,
    torchrec_kernels: Collection[str] = (),
    device: str = "cpu",
    torchrec_plans: Mapping[str, ShardingPlan] | None = None,
) -> dict[str, Measurement]:
    """Train every plan of `plans` on `world_size` local ranks, in turns; time them.

    Args:
        plans: plans of `workload` by name (each placing every table on ranks < world_size).
        workload: tables, batch and MLPs (see `unmeasurable_reason` for what runs).
        world_size: ranks (1 runs in this process when no process group is up); 1 on CUDA.
        options: steps, warm-up, threads.
        torchrec_kernels: names of plans to run on TorchRec's own kernels (see the module
            docstring); on CPU their tables must all be on the device.
        device: "cpu" (gloo ranks) or "cuda" (one GPU; see the module docstring).
        torchrec_plans: TorchRec's planner's own plan (`torchrec_plan(...).plan`) of a plan
            named in `torchrec_kernels`, run with the kernels TorchRec chose
            (`torchrec_runs.from_torchrec`); without one, such a plan runs as
            `torchrec_runs.from_plan` places it.

    Raises:
        DistcacheConfigError: the workload cannot run here, or on `device`.
        RankFailed: a rank failed, or the ranks overran `options.timeout_s`.
    """
    options = options or MeasureOptions()
    torchrec_plans = dict(torchrec_plans or {})
    _check_measurable(workload, world_size, device)
    names = list(plans)
    unknown = sorted(set(torchrec_kernels) - set(names))
    if unknown:
        raise DistcacheConfigError(f"torchrec_kernels names {unknown}, which are not plans here")
    unknown = sorted(set(torchrec_plans) - set(torchrec_kernels))
    if unknown:
        raise DistcacheConfigError(f"torchrec_plans names {unknown}, not in torchrec_kernels")
    for name in torchrec_kernels if device == "cpu" else ():  # TorchRec's caches need CUDA
        cached = [t.table for t in plans[name].tables if t.storage != DEVICE]
        if cached:
            raise DistcacheConfigError(
                f"plan {name!r} cannot run on TorchRec's kernels here: tables {cached} are in "
                "host memory behind a cache, and TorchRec has no cache on CPU"
            )
    theirs = [torchrec_plans.get(n, n in set(torchrec_kernels)) for n in names]
    per_rank = run_ranks(
        _rank_main,
        world_size,
        args=([plans[n] for n in names], workload, options, theirs, device),
        timeout_s=options.timeout_s,
        backend="nccl" if device == "cuda" else "gloo",
        env={"OMP_NUM_THREADS": str(options.threads)},
        alone_in_process=True,
    )
    return {
        name: _summarize(name, [r[i] for r in per_rank], world_size, options)
        for i, name in enumerate(names)
    }


def _check_measurable(workload: Workload, world_size: int, device: str) -> None:
    if device not in DEVICES:
        raise DistcacheConfigError(f"device must be one of {DEVICES}, got {device!r}")
    ranks = 1 if device == "cuda" else MAX_LOCAL_RANKS
    reason = (device == "cuda" and cuda_missing()) or workload_unmeasurable_reason(workload)
    if not reason and not 1 <= world_size <= ranks:
        reason = f"{world_size} ranks; this machine runs 1 to {ranks} on {device}"
    if reason:
        raise DistcacheConfigError(f"cannot measure here: {reason}")


def _rank_main(
    rank: int,
    world: int,
    plans: list[Plan],
    workload: Workload,
    options: MeasureOptions,
    torchrec_kernels: list[bool | ShardingPlan],
    device: str,
) -> list[_RankResult]:
    del rank, world  # the default group knows them
    return _run_here(plans, workload, options, torchrec_kernels, device)


def time_plans_here(
    plans: dict[str, Plan],
    workload: Workload,
    *,
    options: MeasureOptions | None = None,
    device: str = "cpu",
) -> dict[str, list[float]]:
    """This rank's step seconds of each plan, trained by the ranks of the (initialized)
    default process group in turns, as `measure_plans` does; no process is started.

    Args:
        plans: plans of `workload` by name, for the group's size.
        workload: a measurable workload (`unmeasurable_reason`).
        options: steps and warm-up (threads and timeout are the caller's).
        device: "cpu" (a gloo group) or "cuda" (this process's GPU, a one-rank NCCL group).
    """
    options = options or MeasureOptions()
    names = list(plans)
    runs = [False] * len(names)
    results = _run_here([plans[n] for n in names], workload, options, runs, device)
    return {name: r["step_s"] for name, r in zip(names, results, strict=True)}


def _run_here(
    plans: list[Plan],
    workload: Workload,
    options: MeasureOptions,
    torchrec_kernels: list[bool | ShardingPlan],
    device: str = "cpu",
) -> list[_RankResult]:
    """This rank's runs of `plans`; `torchrec_kernels`: each plan through distcache's path
    (False), on TorchRec's kernels as `torchrec_runs.from_plan` places it (True), or as
    TorchRec's own plan of it places it."""
    cuda = device == "cuda"
    where = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    runs = [
        build(runnable_plan(p), workload, options, where)
        if theirs is False
        else build_torchrec(p, None if theirs is True else theirs, workload, options, where)
        for p, theirs in zip(plans, torchrec_kernels, strict=True)
    ]
    return _timed(runs, options, where)


# ---------------------------------------------------------------------------------------------
# One rank: its runs timed (`measure_runs` builds them)


class _RankResult(TypedDict):
    """One rank's run of one plan."""

    step_s: list[float]
    """This rank's time of each timed step."""
    sent_bytes: list[float]
    """Bytes this rank sent in all-to-alls (and row-wise outputs' collectives) in one step,
    all-reduced, and sent in the replicas' all-gathers: [all_to_all, all_reduce, hot_gather]."""
    before: dict[str, float]
    """Cache counters (`_COUNTERS`) before the timed steps ..."""
    after: dict[str, float]
    """... and after them."""


def _timed(runs: list[Run], options: MeasureOptions, device: torch.device) -> list[_RankResult]:
    """Each run trains warmup + steps steps, in turns; per-step times of the timed ones.

    A step starts when every rank is there (CPU: a barrier; CUDA, one rank: the GPU idle) and
    ends when its work is done (CUDA: synchronized)."""
    cuda = device.type == "cuda"
    start_together = (lambda: torch.cuda.synchronize(device)) if cuda else dist.barrier
    times: list[list[float]] = [[] for _ in runs]
    before: list[dict[str, float]] = [{} for _ in runs]
    sent = [[0.0, 0.0, 0.0] for _ in runs]
    for step in range(options.warmup + options.steps):
        if step == options.warmup:
            before = [r.stats() for r in runs]
        shift = step % len(runs)  # rotate the order so no run always follows another
        for i in [*range(shift, len(runs)), *range(shift)]:
            start_together()
            if step < options.warmup:
                runs[i].step()
                continue
            # Counted in a step timed apart (the mode's dispatch would slow the timed one).
            start = time.perf_counter()
            runs[i].step()
            if cuda:
                torch.cuda.synchronize(device)
            times[i].append(time.perf_counter() - start)
    after = [r.stats() for r in runs]
    for i, run in enumerate(runs):  # one more step per run, its collectives counted
        start_together()
        with CollectiveBytes() as counted:
            run.step()
        sent[i] = [counted.all_to_all, counted.all_reduce, counted.hot_gather]
    return [
        {"step_s": times[i], "before": before[i], "after": after[i], "sent_bytes": sent[i]}
        for i in range(len(runs))
    ]


def _summarize(
    name: str, ranks: Sequence[_RankResult], world_size: int, options: MeasureOptions
) -> Measurement:
    per_step = tuple(max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True))
    cache = {
        k: sum(r["after"].get(k, 0.0) - r["before"].get(k, 0.0) for r in ranks)
        / world_size
        / options.steps
        for k in COUNTED
    }
    cache["critical_misses"] = sum(
        r["after"].get("critical_misses", 0.0) - r["before"].get("critical_misses", 0.0)
        for r in ranks
    )
    return Measurement(
        plan=name,
        world_size=world_size,
        step_s=statistics.median(per_step),
        step_s_per_step=per_step,
        cache=cache,
        all_to_all_sent_bytes=sum(r["sent_bytes"][0] for r in ranks) / world_size,
        all_reduce_bytes=sum(r["sent_bytes"][1] for r in ranks) / world_size,
        hot_gather_bytes=sum(r["sent_bytes"][2] for r in ranks) / world_size,
    )
