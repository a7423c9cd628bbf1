"""A plan on TorchRec's own kernels (`distcache.tools.torchrec_runs`), built without a GPU."""

from __future__ import annotations

import dataclasses

import pytest

from distcache.errors import DistcacheConfigError
from distcache.job.dlrm import EBC_PATH, UVM_CACHING_KERNEL
from distcache.planner.solver import uniform_plan
from distcache.planner.topology import preset
from distcache.planner.torchrec.planner import torchrec_plan
from distcache.planner.types import (
    DATA_PARALLEL,
    HOST_CACHED,
    TABLE_WISE,
    Plan,
    TableStats,
    Workload,
)
from distcache.sharding import CachedParameterSharding
from distcache.tools.torchrec_runs import from_plan, from_torchrec, sharders

WORKLOAD = Workload(
    name="dlrm",
    tables=tuple(
        TableStats(name=f"t{i}", rows=rows, dim=8) for i, rows in enumerate((3000, 500, 40))
    ),
    batch_size_per_rank=16,
    bottom_mlp=(8,),
    top_mlp=(4, 1),
)


def _mixed() -> Plan:
    """t0 host-cached at 25 %, t1 on the device with hot rows, t2 data parallel."""
    h100 = preset("h100", world_size=1)
    device = uniform_plan(WORKLOAD, h100, TABLE_WISE)
    cached = uniform_plan(
        WORKLOAD, h100, TABLE_WISE, storage=HOST_CACHED, cache_fraction=0.25, lookahead=2,
        prefetch_depth=1,
    )  # fmt: skip
    hot = dataclasses.replace(device.tables[1], hot_rows=10)
    dp = uniform_plan(WORKLOAD, h100, DATA_PARALLEL).tables[2]
    return Plan(name="mixed", tables=(cached.tables[0], hot, dp))


def test_a_distcache_plan_on_torchrecs_kernels() -> None:
    """Host-cached tables on TorchRec's UVM cache at the plan's fraction, device tables on
    `fused` without distcache's replica, data-parallel ones `dense`; no cache on CPU."""
    (placed,) = from_plan(_mixed(), WORKLOAD, world_size=1, device="cuda").plan.items()
    path, shardings = placed
    assert path == EBC_PATH
    assert shardings["t0"].compute_kernel == UVM_CACHING_KERNEL
    assert shardings["t0"].cache_params.load_factor == 0.25
    assert shardings["t0"].cache_params.algorithm.name == "LRU"
    assert shardings["t1"].compute_kernel == "fused"
    assert shardings["t2"].compute_kernel == "dense"
    assert not any(isinstance(s, CachedParameterSharding) for s in shardings.values())
    with pytest.raises(DistcacheConfigError, match="TorchRec has no cache on CPU"):
        from_plan(_mixed(), WORKLOAD, world_size=1, device="cpu")


def test_torchrecs_own_plan_keeps_its_kernels_renamed_for_the_dlrm() -> None:
    """TorchRec's planner's plan of a workload whose tables are not named `t{i}` (a table named
    `items` is renamed by TorchRec), with device memory for about half the rows."""
    names = ("users", "items", "ads")
    named = dataclasses.replace(
        WORKLOAD,
        tables=tuple(
            dataclasses.replace(t, name=n, rows=200_000 if n == "users" else t.rows)
            for t, n in zip(WORKLOAD.tables, names, strict=True)
        ),
    )
    topology = preset("h100", world_size=1, device_memory_bytes=4 * 10**6)
    result = torchrec_plan(named, topology)
    assert result.error is None
    (placed,) = from_torchrec(result.plan, named).plan.items()
    path, shardings = placed
    assert path == EBC_PATH and sorted(shardings) == ["t0", "t1", "t2"]
    (theirs,) = result.plan.plan.values()
    kernels = [s.compute_kernel for s in theirs.values()]
    assert sorted(s.compute_kernel for s in shardings.values()) == sorted(kernels)
    assert shardings["t0"].compute_kernel.startswith(
        "fused_uvm"
    )  # 6.4 MB of rows: not on the device
    for sharding in shardings.values():
        if sharding.compute_kernel == UVM_CACHING_KERNEL:
            assert 0 < sharding.cache_params.load_factor < 1
    with pytest.raises(DistcacheConfigError, match="expected one module with the tables"):
        from_torchrec(result.plan, WORKLOAD)


def test_torchrecs_sharders_map_uvm_rows_into_host_memory_on_cuda_only() -> None:
    assert all(
        "uvm_host_mapped" not in (getattr(s, "fused_params", None) or {}) for s in sharders("cpu")
    )
    assert sharders("cuda")[-1].fused_params == {"uvm_host_mapped": True}
