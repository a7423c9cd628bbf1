"""`python -m distcache calibrate`: the quick run end to end, and each measurement's sanity."""

import json

import pytest

from distcache.errors import DistcacheConfigError
from distcache.planner.calibrate import (
    QUICK,
    fit_latency_bandwidth,
    main,
    measure_copy_bandwidth,
    measure_dense_flops,
    measure_lookup_rate,
)
from distcache.planner.types import Topology


def test_quick_run_writes_a_valid_topology(tmp_path, capsys):
    out = tmp_path / "topology.json"
    assert main(["--quick", "--ranks", "2", "--out", str(out), "--timeout", "60"]) == 0
    topology = Topology.from_dict(json.loads(out.read_text()))
    assert topology.world_size == topology.ranks_per_node == 2
    assert topology.compute_device == "cpu"
    for name, value in topology.to_dict().items():
        if isinstance(value, float | int) and not isinstance(value, bool):
            assert value > 0, name
    assert "embedding lookup" in capsys.readouterr().err


def test_copy_bandwidth_in_sane_range():
    assert 1e8 <= measure_copy_bandwidth(nbytes=QUICK.copy_bytes, repeats=3) <= 1e12


def test_compute_rates_positive():
    lookup = measure_lookup_rate(rows=10_000, dim=16, bags=256, pooling=4, repeats=2)
    flops = measure_dense_flops(batch=64, widths=(32, 64, 16), repeats=2)
    assert 1e4 < lookup < 1e11
    assert 1e6 < flops < 1e15


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    fit = fit_latency_bandwidth(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bw_bytes_per_s == pytest.approx(2e9, rel=1e-6)


def test_fit_stays_positive_on_noise():
    fit = fit_latency_bandwidth([1e3, 1e6], [2e-3, 1e-3])  # larger message faster: noise
    assert fit.latency_s > 0 and fit.bw_bytes_per_s > 0


def test_bad_arguments_fail_cleanly(capsys):
    assert main(["--quick", "--ranks", "1"]) == 2
    assert "ranks must be >= 2" in capsys.readouterr().err
    with pytest.raises(DistcacheConfigError, match="mlp_widths"):
        type(QUICK)(mlp_widths=(8,))
