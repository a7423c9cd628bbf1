"""Plan comparison, and TorchRec's planner on distcache workloads (CUDA planned on CPU)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from distcache.planner.solver import uniform_plan
from distcache.planner.topology import preset
from distcache.planner.torchrec.export import from_sharding_plan
from distcache.planner.torchrec.planner import torchrec_estimate, torchrec_plan
from distcache.planner.types import HOST_CACHED, ROW_WISE, TABLE_WISE, SolverOptions
from distcache.planner.workloads import workload_preset
from distcache.sharding import CACHED_KERNEL, CachedParameterSharding
from distcache.tools.compare import (
    TERMS,
    ComparisonRow,
    compare,
    format_table,
    rows_to_json,
    speedups,
)

WORKLOAD = workload_preset("synthetic:tables=6,rows=20000,dim=16,seed=1", batch_size_per_rank=256)
FAST = SolverOptions(max_moves=100)


@pytest.fixture(scope="module")
def rows() -> list[ComparisonRow]:
    topology = preset("h100", world_size=4)
    mine = uniform_plan(WORKLOAD, topology, TABLE_WISE, name="mine")
    return compare(WORKLOAD, topology, plans={"mine": mine}, options=FAST)


def test_rows_cover_every_plan_with_consistent_terms(rows: list[ComparisonRow]) -> None:
    assert [r.name for r in rows] == [
        "distcache",
        "torchrec",
        "all table-wise",
        "all row-wise",
        "mine",
    ]
    for row in rows:
        assert row.cost is not None and row.fits, row.name
        assert sum(row.terms_ms.values()) == pytest.approx(row.step_ms)
        assert row.samples_per_s == pytest.approx(4 * 256 / (row.step_ms / 1e3))
        assert row.device_memory_gb > 0
    # Every plan here is device-resident, which TorchRec can express and price.
    assert all(r.torchrec_estimate_s and r.torchrec_estimate_s > 0 for r in rows)
    assert rows[0].planning_s is not None and rows[1].planning_s is not None
    # The solver starts from the uniform baselines, so it is never worse than them.
    assert rows[0].step_ms <= min(r.step_ms for r in rows[2:]) + 1e-9


def test_table_and_json_are_labelled_modelled(rows: list[ComparisonRow]) -> None:
    text = format_table(rows, title="synthetic on 4 H100")
    assert text.splitlines()[0] == "synthetic on 4 H100"
    assert "modelled" in text and "not measured" in text
    for row in rows:
        assert row.name in text
    data = json.loads(rows_to_json(rows, workload=WORKLOAD, topology=preset("h100", world_size=4)))
    assert data["modelled"] is True and data["topology"]["world_size"] == 4
    assert [r["name"] for r in data["rows"]] == [r.name for r in rows]
    first = data["rows"][0]
    assert set(first["terms_ms"]) == {label for label, _ in TERMS}
    assert first["plan"]["tables"][0]["table"] == rows[0].plan.tables[0].table


def test_torchrec_estimate_reprices_torchrecs_own_plan() -> None:
    topology = preset("h100", world_size=4)
    result = torchrec_plan(WORKLOAD, topology)
    assert result.error is None and result.estimate_s > 0 and result.planning_s > 0
    plan = from_sharding_plan(result.plan, WORKLOAD, world_size=4)
    assert torchrec_estimate(plan, WORKLOAD, topology) == pytest.approx(result.estimate_s)


def test_torchrec_prices_lookahead_caches_as_its_own_caches_of_that_size() -> None:
    """TorchRec's model has no look-ahead: a look-ahead cache is priced as TorchRec's UVM cache
    of the same size (no credit for look-ahead); TorchRec has no cache on a CPU topology."""
    topology = preset("h100", world_size=4)
    kwargs = {"storage": HOST_CACHED, "cache_fraction": 0.5}
    ahead = uniform_plan(WORKLOAD, topology, TABLE_WISE, lookahead=4, prefetch_depth=1, **kwargs)
    reactive = uniform_plan(WORKLOAD, topology, TABLE_WISE, **kwargs)
    device = uniform_plan(WORKLOAD, topology, TABLE_WISE)
    assert torchrec_estimate(ahead, WORKLOAD, topology) == torchrec_estimate(
        reactive, WORKLOAD, topology
    )
    assert torchrec_estimate(ahead, WORKLOAD, topology) > torchrec_estimate(
        device, WORKLOAD, topology
    )
    cpu = preset("cpu", world_size=2)
    on_cpu = uniform_plan(WORKLOAD, cpu, TABLE_WISE, lookahead=4, prefetch_depth=1, **kwargs)
    assert torchrec_estimate(on_cpu, WORKLOAD, cpu) is None


def test_torchrec_has_no_row_wise_sharding_on_cpu_and_says_nothing(caplog) -> None:
    """TorchRec's sharders offer row-wise sharding only on CUDA: no estimate there, and none
    of its enumerator's warnings about the constraint that asked for it."""
    cpu, gpu = preset("cpu", world_size=2), preset("h100", world_size=2)
    with caplog.at_level(logging.WARNING):
        assert torchrec_estimate(uniform_plan(WORKLOAD, cpu, ROW_WISE), WORKLOAD, cpu) is None
    assert not caplog.records, caplog.text
    assert torchrec_estimate(uniform_plan(WORKLOAD, gpu, ROW_WISE), WORKLOAD, gpu) > 0


def test_torchrec_failure_is_a_row_not_a_crash() -> None:
    big = workload_preset("synthetic:tables=4,rows=1e6,dim=128,spread=1")
    topology = preset("cpu", world_size=2, device_memory_bytes="100MB")
    result = torchrec_plan(big, topology)
    assert result.plan is None and result.estimate_s is None
    assert "PlannerError" in result.error
    rows = compare(big, topology, options=FAST)
    torchrec = next(r for r in rows if r.name == "torchrec")
    assert torchrec.cost is None and torchrec.note.startswith("planner: PlannerError")
    assert "torchrec" in format_table(rows)  # blanks, not a crash
    json.loads(rows_to_json(rows))


def test_torchrec_plans_with_distcaches_sharder_on_cpu() -> None:
    topology = preset("cpu", world_size=2)
    result = torchrec_plan(WORKLOAD, topology, sharders="distcache")
    assert result.error is None
    shardings = result.plan.plan[""]
    assert {s.compute_kernel for s in shardings.values()} <= {CACHED_KERNEL, "dense"}
    cached = [s for s in shardings.values() if s.compute_kernel == CACHED_KERNEL]
    assert cached and all(isinstance(s, CachedParameterSharding) for s in cached)


def test_hot_rows_get_a_row_without_them_and_their_ratio() -> None:
    """Where the plan replicates hot rows, the same placements without them are priced too."""
    topology = dataclasses.replace(
        preset("cpu", world_size=2), id_overhead_s=2e-6, sync_latency_s=1e-6, name="routing"
    )
    workload = workload_preset(
        "synthetic:tables=3,rows=2e6,dim=16,alpha=1.2,pooling=4,mlp=16", batch_size_per_rank=512
    )
    rows = compare(workload, topology, include_torchrec=False, options=FAST)
    ours, plain = rows[0], rows[1]
    assert plain.name == "distcache without hot rows"
    assert any(t.hot_rows for t in ours.plan.tables)
    assert [t.hot_rows for t in plain.plan.tables] == [0] * len(plain.plan.tables)
    assert [dataclasses.replace(t, hot_rows=0) for t in ours.plan.tables] == list(plain.plan.tables)
    gains = speedups(rows, theirs="all table-wise")
    assert gains["hot_rows_model"] == pytest.approx(plain.cost.step_s / ours.cost.step_s)
    assert gains["hot_rows_model"] > 1
    assert "hot rows replicated" in ours.note
    assert "over the same without hot rows" in format_table(rows)


def test_compare_without_torchrec_skips_its_row_and_estimates() -> None:
    topology = dataclasses.replace(preset("h100", world_size=2), name="h100-pair")
    rows = compare(WORKLOAD, topology, include_torchrec=False, options=FAST)
    assert [r.name for r in rows] == ["distcache", "all table-wise", "all row-wise"]
    assert all(r.torchrec_estimate_s is None for r in rows)


def test_on_cuda_compare_would_run_torchrecs_plan_on_its_uvm_kernels() -> None:
    """`compare --measure --device cuda` for Criteo Terabyte on one H100 with 16 GB for
    embeddings (96 GB of rows), planned here without a GPU: TorchRec's plan runs as its planner
    made it, the large tables in host memory (its UVM cache, LRU, a load factor < 1, or UVM),
    the small ones on the device; distcache's plan is the one `plan` prints."""
    from distcache.job.dlrm import EBC_PATH, UVM_CACHING_KERNEL
    from distcache.planner.solver import solve
    from distcache.tools.compare import measured_runs
    from distcache.tools.torchrec_runs import from_torchrec, sharders

    workload = workload_preset("criteo-terabyte")
    topology = preset("h100", world_size=1, device_memory_bytes=16 * 10**9)
    runs = measured_runs(compare(workload, topology), device="cuda")
    assert set(runs.plans) == {"distcache", "torchrec"}  # the uniform plans do not fit
    assert runs.plans["distcache"] == solve(workload, topology)
    assert runs.torchrec_kernels == ("torchrec",) and runs.engine_twin is None
    (placed,) = from_torchrec(runs.torchrec_plans["torchrec"], workload).plan.items()
    path, shardings = placed
    assert path == EBC_PATH and sorted(shardings) == sorted(f"t{i}" for i in range(26))
    rows = {f"t{i}": t.rows for i, t in enumerate(workload.tables)}
    large = {name for name, n in rows.items() if n > 10**7}  # 5 tables, 20 GB each
    host = {name for name, s in shardings.items() if s.compute_kernel.startswith("fused_uvm")}
    assert host == large
    cached = [s for s in shardings.values() if s.compute_kernel == UVM_CACHING_KERNEL]
    assert cached, "no table on TorchRec's UVM cache"
    for sharding in cached:
        params = sharding.cache_params
        assert 0 < params.load_factor < 1 and params.algorithm.name == "LRU"
        assert not params.prefetch_pipeline  # TrainPipelineSparseDist does not prefetch
    small = {name for name, n in rows.items() if n < 10**6}
    assert {shardings[name].compute_kernel for name in small} <= {"fused", "dense"}
    assert "fused" in {shardings[name].compute_kernel for name in small}
    assert sharders("cuda")[-1].fused_params == {"uvm_host_mapped": True}
    # On CPU TorchRec has no cache: its plan of host-resident tables is not run on its kernels.
    assert measured_runs(compare(workload, topology), device="cpu").torchrec_kernels == ()


def test_the_hot_rows_note_names_a_dozen_tables_at_most():
    """A thousand tables' replicas made one 9 KB line of the table; the plan keeps them all."""
    from distcache.tools.compare import HOT_LISTED, _hot_note

    few = [f"t{i} {10 * i}" for i in range(3)]
    assert _hot_note(few, 5) == "hot rows replicated: t0 0, t1 10, t2 20"
    many = [f"t{i} {10 * i}" for i in range(40)]
    note = _hot_note(many, 1000)
    assert note.startswith("hot rows replicated in 40 of 1,000 tables: t0 0, t1 10, ")
    assert f"t{HOT_LISTED - 1} " in note and f"t{HOT_LISTED} " not in note
    assert note.endswith("... (the plan in --json lists every table's)")
