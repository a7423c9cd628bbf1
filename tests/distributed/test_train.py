"""The training job end to end on 2 CPU ranks: torchrun and torchx launchers, Criteo data,
bad configs, and a rank killed mid-run that resumes to the same parameters, bitwise."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distcache.cache.counters import LOGGED
from distcache.job.config import load_job_config
from distcache.planner.types import HOST_CACHED, TABLE_WISE, Plan, TablePlan

ROOT = Path(__file__).resolve().parents[2]
CRITEO_TINY = ROOT.parent / "shared" / "data" / "criteo_tiny" / "train.tiny.tsv"
SMALL = ["--train.progress_bar=false", "--data.batch_size=32", "--train.log_every=10"]
# A train record of metrics.jsonl, but for the counters the job logs (`LOGGED`).
TRAIN_KEYS = ("kind", "step", "loss", "auc", "samples_per_s", "hit_rate", "wait_fraction")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _torchrun(run_dir: Path, *overrides: str, timeout: int = 240, **env: str):
    return subprocess.run(
        [str(ROOT / "launch" / "torchrun.sh"), f"--run.dir={run_dir}", *SMALL, *overrides],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.timeout(300)
def test_torchrun_two_ranks_trains_and_logs(tmp_path):
    done = _torchrun(tmp_path, "--train.steps=40", "--train.eval_every=20")
    assert done.returncode == 0, done.stderr[-3000:]
    train, evals = _records(tmp_path, "train"), _records(tmp_path, "eval")
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert [r["step"] for r in evals] == [20, 40]
    for r in train:
        assert list(r) == [*TRAIN_KEYS[:6], *LOGGED, *TRAIN_KEYS[6:]]  # the cache's counters
        assert r["critical_misses"] == 0 and r["loads"] > 0 and 0 < r["hit_rate"] < 1
        assert r["samples_per_s"] > 0 and 0 <= r["auc"] <= 1
    assert all(0 <= r["eval_auc"] <= 1 for r in evals)
    (run,) = _records(tmp_path, "run")  # one header per run, before its records
    assert run["start_step"] == 0 and run["world_size"] == 2 and len(run["config_sha256"]) == 16
    resolved = load_job_config(tmp_path / "resolved_config.toml")
    assert resolved.train.steps == 40 and resolved.run.dir == str(tmp_path)


@pytest.mark.timeout(300)
def test_evaluations_between_steps_equal_those_after_a_drained_window(tmp_path):
    """The job evaluates between two steps with the pipeline's window full (the model in
    eval mode reads beside it): its evaluations and its training equal those of a run whose
    window drains at the same steps (a checkpoint there), as every evaluation did before."""
    common = ["--train.steps=30", "--train.eval_every=10"]
    beside = _torchrun(tmp_path / "beside", *common)
    drained = _torchrun(tmp_path / "drained", *common, "--checkpoint.every=10")
    for done in (beside, drained):
        assert done.returncode == 0, done.stderr[-3000:]
    for kind, keys in (("eval", ("step", "eval_loss", "eval_auc")), ("train", ("step", "loss"))):
        ours, theirs = _records(tmp_path / "beside", kind), _records(tmp_path / "drained", kind)
        assert [r["step"] for r in ours] == [10, 20, 30]
        assert [[r[k] for k in keys] for r in ours] == [[r[k] for k in keys] for r in theirs]
    # The caches did other work (no drain, the held-out rows not staged): the same numbers.
    loads = [_records(tmp_path / d, "train")[1]["loads"] for d in ("beside", "drained")]
    assert loads[0] != loads[1], loads


@pytest.mark.timeout(420)
def test_a_killed_rank_resumes_from_the_last_checkpoint_bitwise(tmp_path):
    common = ["--train.steps=30", "--checkpoint.every=10", "--resume"]
    whole = _torchrun(tmp_path / "whole", *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _torchrun(
        tmp_path / "killed",
        *common,
        MAX_RESTARTS="1",
        DISTCACHE_CRASH_AT_STEP="15",
        DISTCACHE_CRASH_RANK="1",
    )
    assert killed.returncode == 0, killed.stderr[-3000:]
    log = killed.stdout + killed.stderr
    assert "fault injection: rank 1 exits after step 15" in log
    assert "resumed from the checkpoint of step 10" in log
    final = {}
    for name in ("whole", "killed"):
        out = tmp_path / f"{name}.pt"
        dcp_to_torch_save(tmp_path / name / "checkpoints" / "step_00000030", out)
        final[name] = torch.load(out, weights_only=False)
    flat = {name: _tensors(state) for name, state in final.items()}
    assert flat["whole"].keys() == flat["killed"].keys()
    assert any("embedding_bags" in k for k in flat["whole"])  # the tables are in there
    assert any("momentum" in k or "sum" in k for k in flat["whole"]), sorted(flat["whole"])
    for key, value in flat["whole"].items():
        assert torch.equal(value, flat["killed"][key]), key


def _tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(_tensors(v, f"{prefix}/{i}"))
    elif isinstance(state, torch.Tensor):
        out[prefix] = state
    return out


@pytest.mark.timeout(300)
def test_torchx_component_runs_the_job(tmp_path):
    done = subprocess.run(
        [
            sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd",
            "launch/components.py:train", "--nproc", "2", "--",
            "--train.steps=10", f"--run.dir={tmp_path}", *SMALL,
        ],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "SUCCEEDED" in done.stdout + done.stderr
    assert [r["step"] for r in _records(tmp_path, "train")] == [10]


def _criteo_hot_plan(tmp_path: Path) -> str:
    """Every Criteo table table-wise, the first three replicating 4 hot rows each."""
    tables = tuple(
        TablePlan(table=f"t{i}", sharding=TABLE_WISE, ranks=(i % 2,), hot_rows=4 * (i < 3))
        for i in range(26)
    )
    path = tmp_path / "hot_plan.json"
    Plan(name="criteo hot rows", tables=tables).save(path)
    return f"--plan.planner={path}"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not CRITEO_TINY.is_file(), reason=f"Criteo sample absent: {CRITEO_TINY}")
@pytest.mark.parametrize("hot", [False, True], ids=["table_wise", "sampled_hot_rows"])
def test_trains_on_criteo_tsv(tmp_path, hot):
    """Raw Criteo, and (hot) a plan replicating rows that rank 0's id sample names and sends
    to rank 1."""
    extra = [_criteo_hot_plan(tmp_path), "--plan.sample_batches=8"] if hot else []
    done = _torchrun(
        tmp_path / "run",
        *extra,
        "--data.source=criteo_tsv",
        f'--data.paths=["{CRITEO_TINY}"]',
        f'--data.eval_paths=["{CRITEO_TINY}"]',
        "--data.table_sizes=[" + ",".join(["1000"] * 26) + "]",
        "--data.eval_batches=4",
        "--train.steps=20",
        "--cache.capacity=0.05",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _records(tmp_path / "run", "train")[-1]["critical_misses"] == 0
    assert 0 <= _records(tmp_path / "run", "eval")[-1]["eval_auc"] <= 1


@pytest.mark.timeout(120)
@pytest.mark.skipif(not CRITEO_TINY.is_file(), reason=f"Criteo sample absent: {CRITEO_TINY}")
def test_a_planning_error_on_rank_zero_fails_every_rank(tmp_path):
    """Rank 0 plans alone; when it cannot (the plan replicates more rows than one sampled
    batch saw), the other rank raises the same error instead of waiting for a plan."""
    plan = tmp_path / "plan.json"
    tables = tuple(
        TablePlan(table=f"t{i}", sharding=TABLE_WISE, ranks=(0,), hot_rows=500 * (i == 0))
        for i in range(26)
    )
    Plan(name="too hot", tables=tables).save(plan)
    done = _torchrun(
        tmp_path / "run",
        f"--plan.planner={plan}",
        "--plan.sample_batches=1",
        "--data.source=criteo_tsv",
        f'--data.paths=["{CRITEO_TINY}"]',
        "--data.table_sizes=[" + ",".join(["1000"] * 26) + "]",
        timeout=100,
    )
    assert done.returncode != 0
    assert done.stderr.count("sample more batches or replicate fewer rows") >= 2, done.stderr[
        -3000:
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("--cache.capcity=0.1", "unknown key(s) ['capcity'] in [cache]"),
        ("--data.source=criteo_tsv", "[data] paths = [] is invalid"),
        ('--data.paths=["/nonexistent.tsv"]', "[data] path '/nonexistent.tsv' does not exist"),
    ],
)
def test_bad_config_fails_before_any_worker_starts(tmp_path, override, match):
    extra = ["--data.source=criteo_tsv"] if "paths=" in override else []
    done = _torchrun(tmp_path, *extra, override, timeout=50)
    assert done.returncode != 0
    assert match in done.stderr, done.stderr[-2000:]
    assert "torch.distributed.run" not in done.stderr  # no worker was launched
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr[-2000:]  # one line
    assert done.stderr.startswith("distcache check: DistcacheConfigError: ")


def test_the_launcher_s_help_is_its_own():
    done = subprocess.run(
        [str(ROOT / "launch" / "torchrun.sh"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("Launch a distcache training job with torchrun on this node.")
    assert "NPROC " in done.stdout and "python -m distcache train --help" in done.stdout


@pytest.mark.timeout(300)
def test_debug_passes_through_the_launcher(tmp_path):
    """`--debug`: the check's traceback for a bad config; a good job runs with it (its ranks
    receive it). The progress bar stays off where stderr is no terminal, log lines carry
    their level, and no third-party warning shows."""
    bad = _torchrun(tmp_path / "bad", "--cache.capcity=0.1", "--debug", timeout=50)
    assert bad.returncode != 0
    assert "Traceback (most recent call last)" in bad.stderr
    assert "DistcacheConfigError: unknown key(s) ['capcity'] in [cache]" in bad.stderr
    done = _torchrun(tmp_path / "good", "--train.steps=10", "--debug", "--train.progress_bar=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in _records(tmp_path / "good", "train")] == [10]
    log = done.stdout + done.stderr
    assert "\r" not in log and "step/s" not in log  # no progress bar into a pipe
    assert "INFO [rank 0] distcache.train: train: step 10, loss" in log
    assert "Warning:" not in log and "py.warnings" not in log, log[-3000:]


@pytest.mark.timeout(120)
def test_an_error_on_the_ranks_is_one_line_each_through_the_launcher(tmp_path):
    """A mistake only the ranks see (a checkpoint this run would overwrite): each rank's
    one-line error, then the launcher's line naming the failed ranks; no traceback, no
    torchrun failure block."""
    (tmp_path / "checkpoints" / "step_00000010").mkdir(parents=True)
    done = _torchrun(tmp_path, "--checkpoint.every=10", "--train.steps=10", timeout=100)
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) <= 3, lines  # a line per rank (one may be stopped first), and the last
    assert all(line.startswith("distcache train: CheckpointError: ") for line in lines[:-1])
    assert "step 10" in lines[0], lines
    assert lines[-1].startswith("launch/torchrun.sh: the job failed on rank "), lines
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


@pytest.mark.timeout(300)
def test_resuming_into_a_changed_model_names_the_tables_and_shapes(tmp_path):
    """A checkpoint of 16-wide tables, resumed by a model of 32-wide ones: one
    `CheckpointError` line per rank naming the tables and both shapes, instead of DCP's
    tracebacks ("Size mismatch between saved ... and current ...")."""
    first = _torchrun(tmp_path, "--train.steps=10", "--checkpoint.every=10")
    assert first.returncode == 0, first.stderr[-3000:]
    wider = ["--model.embedding_dim=32", "--model.bottom_mlp=[64,32]"]
    done = _torchrun(tmp_path, "--train.steps=20", "--checkpoint.every=10", "--resume", *wider)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "CheckpointError" in line]
    assert 1 <= len(errors) <= 2, done.stderr[-3000:]
    assert (
        f"the checkpoint {tmp_path / 'checkpoints' / 'step_00000010'} was written by "
        in (errors[0])
    )
    assert "table 't0' is [100, 16] there, [100, 32] here" in errors[0]
    assert "Traceback" not in done.stderr and "Size mismatch" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("launch/torchrun.sh: the job failed")


def _plan_file(tmp_path: Path) -> str:
    """A distcache plan for the tiny job's tables, saved as `python -m distcache plan` would,
    with its first table host-cached (90 % of its rows in the cache)."""
    from distcache.data.sources import JobData
    from distcache.job.placement import job_topology, job_workload
    from distcache.planner.solver import solve

    config = load_job_config(ROOT / "configs" / "tiny_cpu.toml", ["--data.batch_size=32"])
    data = JobData(config.data, steps=10, rank=0, world_size=2)
    plan = solve(job_workload(config, data), job_topology("cpu", 2))
    first = TablePlan(
        table=plan.tables[0].table, sharding=TABLE_WISE, ranks=(0,), storage=HOST_CACHED,
        cache_fraction=0.9, lookahead=8, prefetch_depth=1,
    )  # fmt: skip
    plan = dataclasses.replace(plan, tables=(first, *plan.tables[1:]))
    path = tmp_path / "plan.json"
    plan.save(path)
    return str(path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("planner", ["distcache", "torchrec", "file"])
def test_every_planner_places_the_job(tmp_path, planner):
    choice = _plan_file(tmp_path) if planner == "file" else planner
    done = _torchrun(tmp_path / "run", f"--plan.planner={choice}", "--train.steps=10")
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = _records(tmp_path / "run", "train")
    assert record["critical_misses"] == 0
    if planner == "distcache":  # the tiny job fits in device memory: TorchRec's kernel, no cache
        assert record["loads"] == 0
    else:  # TorchRec's planner offers distcache's kernel; the plan file caches a table
        assert record["loads"] > 0


@pytest.mark.timeout(300)
def test_a_non_finite_loss_stops_the_job_before_a_checkpoint(tmp_path):
    """A learning rate that blows the loss up: every rank stops at the first checkpoint with
    one error, and no checkpoint of the NaN state exists (nothing for `latest` to point to)."""
    done = _torchrun(
        tmp_path, "--train.steps=30", "--checkpoint.every=10", "--train.dense_learning_rate=1e30"
    )
    assert done.returncode != 0
    assert "NonFiniteError: a loss or dense parameter became NaN or infinite before step 10" in (
        done.stderr
    )
    assert not (tmp_path / "checkpoints" / "latest.json").exists()
    assert not list((tmp_path / "checkpoints").glob("step_*"))
    assert all(r["loss"] is None or math.isfinite(r["loss"]) for r in _records(tmp_path, "train"))


@pytest.mark.timeout(300)
def test_weighted_fp16_tables_train_on_two_ranks(tmp_path):
    """The job with weighted features and fp16 tables, row-wise over 2 ranks."""
    done = _torchrun(
        tmp_path,
        "--train.steps=10",
        "--data.weighted=true",
        "--model.embedding_dtype=fp16",
        "--plan.planner=row_wise",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = _records(tmp_path, "train")
    assert record["critical_misses"] == 0 and record["loads"] > 0
    assert math.isfinite(record["loss"])
