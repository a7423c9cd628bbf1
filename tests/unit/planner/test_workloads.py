"""Workload presets: the Criteo DLRMs and the synthetic generator."""

import pytest

from distcache.errors import DistcacheConfigError
from distcache.planner.types import TableStats, Workload
from distcache.planner.workloads import (
    CRITEO_KAGGLE_ROWS,
    CRITEO_TERABYTE_ROWS,
    SYNTHETIC_DEFAULTS,
    WORKLOAD_PRESETS,
    workload_preset,
)


@pytest.mark.parametrize(
    "spec, rows", [("criteo-terabyte", CRITEO_TERABYTE_ROWS), ("criteo-kaggle", CRITEO_KAGGLE_ROWS)]
)
def test_criteo_presets(spec, rows):
    workload = workload_preset(spec)
    assert [t.name for t in workload.tables] == [f"t{i}" for i in range(26)]
    assert tuple(t.rows for t in workload.tables) == rows
    assert {(t.dim, t.pooling_factor, t.alpha) for t in workload.tables} == {(128, 1.0, 1.05)}
    assert workload.bottom_mlp == (512, 256, 128)
    assert workload.top_mlp == (1024, 1024, 512, 256, 1)
    assert workload.dense_in_features == 13


def test_criteo_sizes():
    assert sum(CRITEO_TERABYTE_ROWS) == 187_767_399  # the sum of the published sizes
    assert max(CRITEO_TERABYTE_ROWS) == 39_979_771
    assert sum(CRITEO_KAGGLE_ROWS) == 33_762_577
    assert max(CRITEO_KAGGLE_ROWS) == 10_131_227


def test_overrides():
    workload = workload_preset("criteo-kaggle", batch_size_per_rank=64, optimizer="adam")
    assert (workload.batch_size_per_rank, workload.optimizer) == (64, "adam")
    with pytest.raises(DistcacheConfigError, match="optimizer"):
        workload_preset("criteo-kaggle", optimizer="lion")


def test_synthetic_defaults_and_spread():
    workload = workload_preset("synthetic")
    rows = [t.rows for t in workload.tables]
    top = SYNTHETIC_DEFAULTS["rows"]
    assert len(rows) == SYNTHETIC_DEFAULTS["tables"]
    assert all(top / SYNTHETIC_DEFAULTS["spread"] <= r <= top for r in rows)
    assert len(set(rows)) > 1  # mixed sizes


def test_synthetic_keys_and_determinism():
    spec = "synthetic:tables=7,rows=1e5,dim=32,alpha=0.9,pooling=3,seed=4"
    a, b = workload_preset(spec), workload_preset(spec)
    assert [t.rows for t in a.tables] == [t.rows for t in b.tables]
    assert len(a.tables) == 7
    assert {(t.dim, t.alpha, t.pooling_factor) for t in a.tables} == {(32, 0.9, 3.0)}
    other = workload_preset("synthetic:tables=7,rows=1e5,dim=32,alpha=0.9,pooling=3,seed=5")
    assert [t.rows for t in other.tables] != [t.rows for t in a.tables]
    fixed = workload_preset("synthetic:tables=3,rows=5000,spread=1")
    assert [t.rows for t in fixed.tables] == [5000] * 3
    assert a.bottom_mlp == (512, 256, 128)  # mlp=0: DLRM's MLPs, as Criteo's


def test_synthetic_mlps_sized_to_the_tables():
    workload = workload_preset("synthetic:tables=4,dim=16,mlp=32")
    assert (workload.bottom_mlp, workload.top_mlp) == ((32, 16), (32, 1))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("criteo-petabyte", "allowed"),
        ("synthetic:shards=3", "keys"),
        ("synthetic:tables", "key=value"),
        ("synthetic:rows=lots", "not a number"),
        ("synthetic:tables=2.5", "integer"),
        ("synthetic:tables=0", "tables must be >= 1"),
        ("synthetic:alpha=-1", "alpha"),
        ("synthetic:mlp=-4", "mlp must be >= 0"),
        ("criteo-kaggle:dim=64", "no arguments"),
    ],
)
def test_errors(spec, message):
    with pytest.raises(DistcacheConfigError, match=message):
        workload_preset(spec)
    assert "synthetic" in WORKLOAD_PRESETS


def test_duplicate_table_names_are_named():
    tables = [TableStats(name=n, rows=10, dim=8) for n in ("a", "b", "a", "c", "b")]
    with pytest.raises(DistcacheConfigError, match=r"duplicate table names \['a', 'b'\]: names"):
        Workload(name="w", tables=tables)
