"""A plan on TorchRec's own kernels: the `ShardingPlan` and sharders with which `measure` runs
TorchRec's side of a comparison, for the measured DLRM (`build_dlrm`: table i is `t{i}`, its
EBC at `EBC_PATH`).

- `from_torchrec`: the plan TorchRec's planner made (`torchrec_plan(...).plan`), each table on
  the kernel TorchRec chose: `dense` (data parallel), `fused` (every row in device memory),
  `fused_uvm_caching` (FBGEMM's UVM cache: the rows in host memory, the table's cache load
  factor of them cached in device memory, LRU; the load factor TorchRec's plan carries, else
  the default its planner priced, `UVM_CACHING_RATIO`), `fused_uvm` (the rows in host memory,
  no cache).
- `from_plan`: a distcache plan on TorchRec's kernels: device-stored tables on `fused`,
  data-parallel ones `dense`, host-cached ones on `fused_uvm_caching` (LRU) at the plan's cache
  fraction, which needs CUDA (TorchRec has no cache on CPU); distcache's hot-row replicas are
  dropped.

A UVM cache here never prefetches (`CacheParams.prefetch_pipeline` False): TorchRec's side
trains under `TrainPipelineSparseDist`. On CUDA its EBC sharder maps UVM rows into page-locked
host memory (`sharders`: `uvm_host_mapped`, as `benchmarks/throughput.py` runs it). Neither
plan needs a GPU to be built, so what `compare --measure --device cuda` would run is checked
on CPU.

Example::

    result = torchrec_plan(workload, preset("h100", world_size=1))
    sharding_plan = from_torchrec(result.plan, workload)
"""

from __future__ import annotations

import dataclasses

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.constants import UVM_CACHING_RATIO
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import CacheParams, ModuleSharder, ParameterSharding, ShardingPlan

from distcache.errors import DistcacheConfigError
from distcache.job.dlrm import EBC_PATH, UVM_CACHING_KERNEL, table_name
from distcache.planner.torchrec.export import to_sharding_plan
from distcache.planner.torchrec.modules import torchrec_names
from distcache.planner.types import HOST_CACHED, Plan, Workload
from distcache.sharding.parameter_sharding import FUSED_KERNEL


def from_torchrec(sharding_plan: ShardingPlan, workload: Workload) -> ShardingPlan:
    """TorchRec's planner's plan of `workload` (its EBC's tables named by `torchrec_names`) as
    the measured DLRM takes it: the same shardings and kernels, at `EBC_PATH`, table i named
    `t{i}`, each `fused_uvm_caching` table's cache LRU at its load factor (see the module
    docstring).

    Raises:
        DistcacheConfigError: the plan does not place exactly the workload's tables.
    """
    names = torchrec_names(workload)
    dlrm_names = {names[t.name]: table_name(i) for i, t in enumerate(workload.tables)}
    modules = list(sharding_plan.plan.values())
    if len(modules) != 1 or set(modules[0]) != set(dlrm_names):
        placed = [sorted(m) for m in modules]
        raise DistcacheConfigError(
            f"TorchRec's plan places {placed}: expected one module with the tables "
            f"{sorted(dlrm_names)} of workload {workload.name!r}"
        )
    module_plan = {}
    for name, sharding in modules[0].items():
        if sharding.compute_kernel == UVM_CACHING_KERNEL:
            params = sharding.cache_params
            load = params.load_factor if params and params.load_factor else UVM_CACHING_RATIO
            sharding = dataclasses.replace(sharding, cache_params=lru_cache_params(load, params))
        module_plan[dlrm_names[name]] = sharding
    return ShardingPlan({EBC_PATH: module_plan})


def from_plan(plan: Plan, workload: Workload, *, world_size: int, device: str) -> ShardingPlan:
    """A distcache plan on TorchRec's kernels (see the module docstring), for the measured DLRM.

    Args:
        plan: places every table of `workload`.
        workload: its tables named as `build_dlrm` names them (`t{i}`).
        world_size: ranks.
        device: "cpu" or "cuda".

    Raises:
        DistcacheConfigError: a host-cached table on CPU, where TorchRec has no cache.
    """
    cached = [t.table for t in plan.tables if t.storage == HOST_CACHED]
    if cached and device != "cuda":
        raise DistcacheConfigError(
            f"plan {plan.name!r} cannot run on TorchRec's kernels here: tables {cached} are in "
            "host memory behind a cache, and TorchRec has no cache on CPU"
        )
    sharding_plan = to_sharding_plan(
        plan, workload, module_path=EBC_PATH, world_size=world_size, device=device
    )
    for module_plan in sharding_plan.plan.values():
        for name, sharding in list(module_plan.items()):
            # TorchRec's own ParameterSharding: without distcache's CacheConfig (a replica of
            # hot rows is distcache's, and TorchRec's run has none).
            fields = {
                f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)
            }
            table = plan.table(name)
            if table.storage == HOST_CACHED:
                fields["compute_kernel"] = UVM_CACHING_KERNEL
                fields["cache_params"] = lru_cache_params(table.cache_fraction)
            elif fields["compute_kernel"] != "dense":
                fields["compute_kernel"] = FUSED_KERNEL
            module_plan[name] = ParameterSharding(**fields)
    return sharding_plan


def lru_cache_params(load_factor: float, base: CacheParams | None = None) -> CacheParams:
    """FBGEMM's UVM cache as TorchRec's side runs it: LRU, `load_factor` of the rows, no
    prefetch pipeline; `base`'s other settings kept."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

    return dataclasses.replace(
        base or CacheParams(),
        algorithm=CacheAlgorithm.LRU,
        load_factor=float(load_factor),
        prefetch_pipeline=False,
    )


def sharders(device: str) -> list[ModuleSharder]:
    """TorchRec's default sharders; on CUDA its EBC sharder maps UVM rows into page-locked host
    memory (`uvm_host_mapped`) instead of managed memory."""
    out = get_default_sharders()
    if device == "cuda":  # the last sharder of a type wins
        out.append(EmbeddingBagCollectionSharder(fused_params={"uvm_host_mapped": True}))
    return out
