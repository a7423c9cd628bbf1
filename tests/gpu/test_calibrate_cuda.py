"""`python -m distcache calibrate --device cuda --quick` (issue 35, item 1) on one GPU: every
figure the GPU cost model reads comes out of a measurement, positive, and the topology names
the GPU and the date.

Without TorchRec and FBGEMM's CUDA build the framework's costs (and without the latter
FBGEMM's lookup rates) keep the preset's values, which the topology's `calibration` must say.
The plumbing is checked on CPU with every measurement stubbed
(`tests/unit/tools/test_calibrate.py`).
"""

from __future__ import annotations

import pytest
import torch

from distcache.planner.topology import load_topology, preset
from distcache.tools.calibrate import main
from distcache.tools.framework_costs import FrameworkCosts
from distcache.tools.machine import cuda_missing
from tests.gpu.common import CUDA_REASON
from tests.unit.tools.test_calibrate import CUDA_MEASURED

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)
MAY_BE_NONE = ("lookup_bytes_per_s", "device_lookup_bytes_per_s", "cache_scan_rows_per_s",
               "reactive_cache_s_per_miss")  # fmt: skip
"""Per-byte parts, the scheduler's fallback and the UVM cache's misses: None where the fit
cannot tell them apart."""
MAY_BE_ZERO = ("interaction_s_per_pair", "sharding_overhead_s", "id_overhead_s",
               "hot_bag_overhead_s", "schedule_s_per_id", "schedule_s_per_candidate")  # fmt: skip
"""Costs a fit keeps >= 0, which a GPU may not show."""


def test_quick_calibration_measures_every_figure(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["--device", "cuda", "--ranks", "1", "--quick", "--out", str(out)]) == 0
    print(capsys.readouterr().err)  # the summary, for the session's log
    topology = load_topology(out)
    assert topology.compute_device == "cuda"
    assert torch.cuda.get_device_name() in topology.calibration
    unmeasured = set()
    missing = cuda_missing()
    if missing:  # the preset's values stand, and the topology says so
        assert f"framework costs not measured ({missing})" in topology.calibration
        unmeasured = set(FrameworkCosts.__dataclass_fields__)
        gpu = preset("h100", world_size=1)
        assert all(getattr(topology, name) == getattr(gpu, name) for name in unmeasured)
    if "the data-parallel plans failed" in topology.calibration:  # (a pruned FBGEMM build)
        unmeasured.add("dense_update_bytes_per_s")
    if "FBGEMM's TBE not measured" in topology.calibration:
        unmeasured |= {"device_lookup_rows_per_s", "device_lookup_bytes_per_s"}
    if "FBGEMM's TBE not measured" in topology.calibration or "UVM cache" in topology.calibration:
        unmeasured |= {"reactive_cache_s_per_id", "reactive_cache_s_per_miss"}  # (noted)
    for name in set(CUDA_MEASURED) - unmeasured:
        value = getattr(topology, name)
        if name in MAY_BE_NONE and value is None:
            continue
        assert value is not None and (value > 0 or name in MAY_BE_ZERO and value == 0), (
            f"{name} = {value}; {topology.calibration}"
        )
    assert topology.schedule_s_per_id + topology.schedule_s_per_candidate > 0
