"""`compare --measure --device cuda` (issue 35, item 2) on one GPU, small tables and few steps:
distcache's plans through its sharder and look-ahead pipeline beside plans on TorchRec's own
kernels, FBGEMM's UVM cache (`fused_uvm_caching`) among them, in one process.

Needs TorchRec and FBGEMM's CUDA build (`benchmarks/gpu_session.sh` installs them from `.whl`
and `.fbg`); skipped, naming what is missing, without them. The plan side of this path is
checked on CPU (`tests/unit/tools/test_compare.py`, `test_torchrec_runs.py`).
"""

from __future__ import annotations

import json

import pytest
import torch

from distcache.planner.types import DEVICE as ON_DEVICE
from distcache.planner.types import HOST_CACHED, TABLE_WISE, Plan, TablePlan, TableStats, Workload
from tests.gpu.common import CUDA_REASON

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)
WORKLOAD = Workload(
    name="small",
    tables=(TableStats(name="t0", rows=100_000, dim=16), TableStats(name="t1", rows=2_000, dim=16)),
    batch_size_per_rank=512,
    bottom_mlp=(16,),
    top_mlp=(16, 1),
)
SYNTHETIC = "synthetic:tables=4,rows=200000,dim=16,mlp=32,spread=10,seed=1"


@pytest.fixture(autouse=True)
def _cuda_build() -> None:
    """TorchRec, and FBGEMM's CUDA kernels for it (imported here: the GPU machine may lack
    TorchRec, and collecting this module must not fail there)."""
    pytest.importorskip("torchrec")
    from distcache.tools.machine import cuda_missing

    missing = cuda_missing()
    if missing:
        pytest.skip(missing)


def test_two_plans_run_side_by_side_on_the_gpu() -> None:
    """t0 host-cached at 5 %, t1 on the device: through distcache's path, and on TorchRec's
    kernels (t0 on FBGEMM's UVM cache at 5 %, LRU, host-mapped)."""
    from distcache.tools.measure import MeasureOptions, measure_plans

    plan = Plan(
        name="mixed",
        tables=(
            TablePlan(
                table="t0", sharding=TABLE_WISE, ranks=(0,), storage=HOST_CACHED,
                cache_fraction=0.05, lookahead=4, prefetch_depth=1,
            ),
            TablePlan(table="t1", sharding=TABLE_WISE, ranks=(0,), storage=ON_DEVICE),
        ),
    )  # fmt: skip
    results = measure_plans(
        {"distcache": plan, "torchrec": plan},
        WORKLOAD,
        world_size=1,
        options=MeasureOptions(steps=5, warmup=3),
        torchrec_kernels=["torchrec"],
        device=DEVICE,
    )
    for name, measured in results.items():
        assert measured.step_s > 0 and len(measured.step_s_per_step) == 5, name
    assert results["distcache"].cache["ids"] == WORKLOAD.batch_size_per_rank  # t0's cache
    assert results["distcache"].cache["critical_misses"] == 0
    assert results["torchrec"].cache["ids"] == 0  # FBGEMM's cache, not distcache's


def test_compare_measure_on_the_gpu_prints_measured_beside_modelled(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Through the CLI, with device memory for about half the rows: TorchRec's plan on the
    kernels its planner chose, UVM ones included, and distcache's, both measured."""
    from distcache.tools.plan_cli import compare_main

    args = ["--preset", SYNTHETIC, "--batch-size", "512", "--topology", "h100"]
    args += ["--world-size", "1", "--device-memory", "20MB", "--json"]
    args += ["--measure", "--device", DEVICE, "--measure-steps", "3", "--measure-warmup", "2"]
    assert compare_main(args) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["measured"] is True, captured.err
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("distcache", "torchrec"):
        assert rows[name]["measured_step_ms"] > 0 and rows[name]["step_ms"] > 0, name
    assert "as its planner chose them" in rows["torchrec"]["note"]
    assert "fused_uvm" in rows["torchrec"]["note"]  # some rows in host memory
    assert data["distcache_over_torchrec"]["measured"] > 0
