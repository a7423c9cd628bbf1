"""Plans run for real on this machine (`distcache.tools.measure`) and `compare --measure`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from distcache.errors import DistcacheConfigError
from distcache.planner.cost import all_to_all_sent_bytes
from distcache.planner.solver import uniform_plan
from distcache.planner.topology import preset
from distcache.planner.types import (
    DATA_PARALLEL,
    HOST_CACHED,
    TABLE_WISE,
    Plan,
    TableStats,
    Workload,
)
from distcache.tools.measure import (
    MeasureOptions,
    measure_plans,
    runnable_plan,
    unmeasurable_reason,
)
from distcache.tools.plan_cli import compare_main

WORKLOAD = Workload(
    name="tiny",
    tables=(TableStats(name="users", rows=3000, dim=8), TableStats(name="ads", rows=500, dim=8)),
    batch_size_per_rank=16,
    bottom_mlp=(8,),
    top_mlp=(4, 1),
)
FEW = MeasureOptions(steps=3, warmup=2)
CONFIG = """
[model]
name = "tiny"
batch_size_per_rank = 16
bottom_mlp = [8]
top_mlp = [4, 1]

[[tables]]
name = "users"
rows = 3000
dim = 8

[[tables]]
name = "ads"
rows = 500
dim = 8
alpha = 1.2
"""


def test_plans_train_on_one_rank_with_their_caches() -> None:
    cpu = preset("cpu", world_size=1)
    device = uniform_plan(WORKLOAD, cpu, TABLE_WISE)
    cached = uniform_plan(
        WORKLOAD, cpu, TABLE_WISE, storage=HOST_CACHED, cache_fraction=0.5, lookahead=2,
        prefetch_depth=1,
    )  # fmt: skip
    mixed = Plan(
        name="mixed",
        tables=(cached.tables[0], uniform_plan(WORKLOAD, cpu, DATA_PARALLEL).tables[1]),
    )
    plans = {"device": device, "cached": cached, "mixed": mixed}
    results = measure_plans(plans, WORKLOAD, world_size=1, options=FEW)
    assert set(results) == set(plans)
    for name, m in results.items():
        assert m.step_s > 0 and len(m.step_s_per_step) == FEW.steps, name
        assert m.cache["critical_misses"] == 0, name  # staged ahead, or every row resident
    assert results["device"].cache["loads"] == 0  # device storage: every row resident
    assert results["cached"].cache["ids"] == 2 * 16  # one id per sample and table


def test_device_tables_join_the_look_ahead_window() -> None:
    cpu = preset("cpu", world_size=1)
    plan = uniform_plan(WORKLOAD, cpu, TABLE_WISE)
    cached = dataclasses.replace(
        plan.tables[0], storage=HOST_CACHED, cache_fraction=0.5, lookahead=4, prefetch_depth=1
    )
    run = runnable_plan(dataclasses.replace(plan, tables=(cached, plan.tables[1])))
    assert (run.tables[1].lookahead, run.tables[1].prefetch_depth) == (4, 1)
    assert runnable_plan(plan) == plan


def test_what_cannot_run_here_is_refused_with_a_reason() -> None:
    assert unmeasurable_reason(WORKLOAD, preset("cpu", world_size=2)) is None
    assert "cuda" in unmeasurable_reason(WORKLOAD, preset("h100", world_size=2))
    assert "at most 2" in unmeasurable_reason(WORKLOAD, preset("cpu", world_size=8))
    wide = dataclasses.replace(WORKLOAD, bottom_mlp=(8, 16))
    assert "embedding dim" in unmeasurable_reason(wide, preset("cpu", world_size=1))
    with pytest.raises(DistcacheConfigError, match="embedding dim"):
        measure_plans({}, wide, world_size=1)
    tables = (WORKLOAD.tables[0], dataclasses.replace(WORKLOAD.tables[1], pooled=False))
    sequence = dataclasses.replace(WORKLOAD, tables=tables)
    assert "tables ['ads'] are sequence tables" in unmeasurable_reason(
        sequence, preset("cpu", world_size=1)
    )


def test_compare_measure_runs_every_plan_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG)
    args = ["--config", str(config), "--topology", "cpu", "--world-size", "1", "--json"]
    args += ["--measure", "--measure-steps", "2", "--measure-warmup", "1"]
    assert compare_main(args) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["measured"] is True
    # A preset is not this machine: the gap is named, and the command that closes it.
    hint = captured.err.splitlines()[-1]
    assert "is not a calibration of this machine: the measured steps are " in hint
    assert "`python -m distcache calibrate --ranks 1 --out topology.json`" in hint
    rows = {r["name"]: r for r in data["rows"]}
    assert {"distcache", "torchrec", "all table-wise"} <= set(rows)
    for name in ("distcache", "torchrec", "all table-wise"):  # TorchRec's plan runs too
        assert rows[name]["measured_step_ms"] > 0, name
        assert rows[name]["step_ms"] > 0  # the modelled figure stays beside it
    # TorchRec's plan ran on TorchRec's kernels, and through distcache's path beside them.
    assert "TorchRec's own kernels" in rows["torchrec"]["note"]
    assert rows["torchrec"]["measured_on_distcache_engine_step_ms"] > 0
    gains = data["distcache_over_torchrec"]
    assert gains["measured"] > 0 and gains["measured_same_engine"] > 0


def test_compare_measure_skips_topologies_larger_than_this_machine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "synthetic:tables=2,rows=2000,dim=16,seed=1"
    args = ["--preset", spec, "--topology", "h100", "--world-size", "8", "--no-torchrec"]
    assert compare_main([*args, "--measure"]) == 0
    captured = capsys.readouterr()
    assert "--measure: not measured" in captured.err and "modelled" in captured.err
    assert "calibration" not in captured.err  # (nothing ran: no gap to name)
    assert "measured ms" not in captured.out and "modelled" in captured.out


def test_a_calibrated_topology_gets_no_calibration_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from distcache.tools.plan_cli import _uncalibrated_hint

    row = SimpleNamespace(measured_step_s=0.02, cost=SimpleNamespace(step_s=0.001))
    args = SimpleNamespace(device="cpu")
    calibrated = dataclasses.replace(preset("cpu", world_size=2), calibration="calibrated here")
    _uncalibrated_hint([row], calibrated, args)
    assert capsys.readouterr().err == ""
    _uncalibrated_hint([row], preset("cpu", world_size=2), args)
    assert "the measured steps are 20-20 x the modelled ones" in capsys.readouterr().err


def test_a_plan_runs_on_torchrecs_own_kernels() -> None:
    """`torchrec_kernels`: the plan on TorchRec's `fused` kernel and sharders (no distcache
    cache is involved), side by side with plans through distcache's path."""
    cpu = preset("cpu", world_size=1)
    device = uniform_plan(WORKLOAD, cpu, TABLE_WISE)
    cached = uniform_plan(
        WORKLOAD, cpu, TABLE_WISE, storage=HOST_CACHED, cache_fraction=0.5, lookahead=2,
        prefetch_depth=1,
    )  # fmt: skip
    plans = {"distcache": cached, "torchrec": device, "device": device}
    results = measure_plans(
        plans, WORKLOAD, world_size=1, options=FEW, torchrec_kernels=["torchrec"]
    )
    assert all(r.step_s > 0 for r in results.values())
    assert results["torchrec"].cache["ids"] == 0  # TorchRec's kernel: no distcache cache
    assert results["distcache"].cache["ids"] == 2 * 16
    # distcache's export keeps device-stored tables on TorchRec's fused kernel too
    assert results["device"].cache["ids"] == 0
    with pytest.raises(DistcacheConfigError, match="TorchRec has no cache on CPU"):
        measure_plans({"c": cached}, WORKLOAD, world_size=1, torchrec_kernels=["c"])
    with pytest.raises(DistcacheConfigError, match="not plans here"):
        measure_plans({"c": device}, WORKLOAD, world_size=1, torchrec_kernels=["x"])


def test_all_to_all_bytes_are_counted_and_match_the_model() -> None:
    """On 2 ranks, the bytes a rank sends in a step's all-to-alls (`CollectiveBytes`) are the
    model's (`all_to_all_sent_bytes`: ids once, embeddings forward and backward) plus what the
    model leaves out: TorchRec's lengths (4 bytes per bag sent) and split sizes. A plan moves
    the same bytes on TorchRec's kernels as on distcache's; data parallel moves none."""
    cpu = preset("cpu", world_size=2)
    plans = {k: uniform_plan(WORKLOAD, cpu, k) for k in (TABLE_WISE, "row_wise", DATA_PARALLEL)}
    plans["torchrec"] = plans[TABLE_WISE]
    results = measure_plans(
        plans, WORKLOAD, world_size=2, options=FEW, torchrec_kernels=["torchrec"]
    )
    for name, plan in plans.items():
        modelled = float(all_to_all_sent_bytes(plan, WORKLOAD, cpu).mean())
        measured = results[name].all_to_all_sent_bytes
        lengths = 4 * 16 * len(WORKLOAD.tables)  # at most every table's bags sent
        assert modelled <= measured <= modelled + lengths + 64, (name, measured, modelled)
    assert results[DATA_PARALLEL].all_to_all_sent_bytes == 0
    assert results[DATA_PARALLEL].all_reduce_bytes > results[TABLE_WISE].all_reduce_bytes
    assert results["torchrec"].all_to_all_sent_bytes == results[TABLE_WISE].all_to_all_sent_bytes


def test_on_cuda_one_rank_of_a_cuda_topology_runs_when_its_rows_fit_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h100 = preset("h100", world_size=1)
    assert unmeasurable_reason(WORKLOAD, h100, device="cuda") is None
    assert "not a CUDA one" in unmeasurable_reason(
        WORKLOAD, preset("cpu", world_size=1), device="cuda"
    )
    assert "runs one" in unmeasurable_reason(WORKLOAD, preset("h100", world_size=2), device="cuda")
    rows = 3500 * 8 * 4  # bytes of every row (SGD keeps no state)
    monkeypatch.setattr("distcache.tools.machine.machine_memory_bytes", lambda: 2 * rows)
    assert unmeasurable_reason(WORKLOAD, h100, device="cuda", plans=2) is None
    reason = unmeasurable_reason(WORKLOAD, h100, device="cuda", plans=3)
    assert "host memory per plan" in reason and "for 3" in reason
    with pytest.raises(DistcacheConfigError, match="device must be one of"):
        unmeasurable_reason(WORKLOAD, h100, device="tpu")


def test_measuring_on_cuda_without_it_is_refused_naming_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = uniform_plan(WORKLOAD, preset("h100", world_size=1), TABLE_WISE)
    with pytest.raises(DistcacheConfigError, match="no CUDA device here"):
        measure_plans({"p": plan}, WORKLOAD, world_size=1, device="cuda")
