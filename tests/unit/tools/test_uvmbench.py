"""`distcache.tools.uvmbench` without a GPU: the steps it times stubbed with a cache whose extra
time is known per id and per miss, the figures it fits are those (FBGEMM's UVM cache itself
runs in `tests/gpu/test_calibrate_cuda.py`)."""

import math

import pytest

from distcache.planner.binned import table_access
from distcache.planner.types import TableStats
from distcache.tools import uvmbench


def test_the_fit_recovers_a_caches_cost_per_id_and_per_miss(monkeypatch):
    rows, dim, alpha, pooling = 200_000, 16, 1.05, 4
    access = table_access(TableStats(name="t", rows=rows, dim=dim, alpha=alpha))
    timed = []

    def step(rows_, dim_, bags, pooling_, alpha_, fraction, repeats):
        timed.append((bags, fraction))
        ids = bags * pooling_
        every_row_in_hbm = 2e-4 + 1e-9 * ids
        if fraction is None:
            return every_row_in_hbm
        misses = access.loads(ids, math.ceil(fraction * rows_), "lru")
        return every_row_in_hbm + 5e-5 + 3e-9 * ids + 4e-7 * misses

    monkeypatch.setattr(uvmbench, "_uvm_step", step)
    costs = uvmbench.measure_uvm_cache_costs(
        rows=rows, dim=dim, bags=(256, 2048), pooling=pooling, alpha=alpha, device="cuda"
    )
    assert costs.s_per_id == pytest.approx(3e-9) and costs.s_per_miss == pytest.approx(4e-7)
    assert sorted(timed, key=str) == sorted(
        [(256, None), (2048, None), (256, 0.05), (2048, 0.05), (2048, 0.2)], key=str
    )


def test_not_on_cuda_it_says_so():
    with pytest.raises(NotImplementedError, match="CUDA only"):
        uvmbench.measure_uvm_cache_costs(rows=1000, bags=(8, 16), device="cpu")
