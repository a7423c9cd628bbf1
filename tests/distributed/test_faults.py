"""The fault suite: the training job on 2 CPU ranks (torchrun) meets a damaged checkpoint, a
rank killed while saving, a bad batch and a NaN loss, and either refuses with one clear line or
trains on to parameters bitwise equal to a clean run's. Faults are injected by
`fault_job.py`, which runs `python -m distcache train` unchanged otherwise."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--config", "configs/tiny_cpu.toml", "--train.progress_bar=false", "--data.batch_size=32"]
EVERY_10 = ["--checkpoint.every=10", "--train.log_every=10"]
BAD_STEP = 12  # the batch the bad-batch tests spoil, and the clean run leaves out


def _job(run_dir: Path, *overrides: str, restarts: int = 0, timeout: int = 200, **env: str):
    """`fault_job.py` under torchrun on 2 ranks; returns the finished process."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--max-restarts={restarts}", str(ROOT / "tests" / "distributed" / "fault_job.py"),
        *JOB, f"--run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout
    )


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def _params(run_dir: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    """The tensors of a run's checkpoint of `step`: model, fused and dense optimizer state."""
    source = run_dir / "checkpoints" / f"step_{step:08d}"
    out = tmp / f"{run_dir.name}_{step}.pt"
    dcp_to_torch_save(source, out)
    flat = _flat(torch.load(out, weights_only=False))
    flat.update(_flat(torch.load(source / "dense_optimizer.pt", weights_only=False), "dense"))
    return flat


def _flat(state: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    if not isinstance(state, dict | list | tuple):
        return {}
    return {k: v for key, value in items for k, v in _flat(value, f"{prefix}/{key}").items()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert any("embedding_bags" in k for k in a)  # the tables are compared too
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 steps, a checkpoint every 10, no fault: the reference for the checkpoint faults."""
    run_dir = tmp_path_factory.mktemp("faults") / "clean"
    _ok(_job(run_dir, "--train.steps=30", *EVERY_10))
    return run_dir


@pytest.fixture(scope="module")
def without_bad_batch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job on data without batch BAD_STEP: 29 steps, ending in a checkpoint of 29."""
    run_dir = tmp_path_factory.mktemp("faults") / "without"
    _ok(_job(run_dir, "--train.steps=29", *EVERY_10, FAULT_BATCH=f"{BAD_STEP}:0:drop"))
    return run_dir


@pytest.fixture(scope="module")
def twenty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 steps, a checkpoint every 10: the run the checkpoint faults damage (each a copy).
    Its log beside it (`twenty.log`)."""
    run_dir = tmp_path_factory.mktemp("faults") / "twenty"
    log = _ok(_job(run_dir, "--train.steps=20", *EVERY_10))
    (run_dir.parent / "twenty.log").write_text(log)
    return run_dir


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads listed from /proc")
def test_a_finished_job_leaves_no_gloo_thread_to_the_interpreters_shutdown(twenty: Path):
    """Each rank's process groups end (gloo's threads joined) before the interpreter shuts
    down. A group kept alive past the job keeps its threads running into the shutdown, where
    one aborted a finished rank now and then ("terminate called without an active
    exception"): held by the model (its reference cycles), or by a default argument of
    torch.distributed.optim imported after the group started (`process_group` collects the
    first and imports the second before the group starts). `fault_job.py` lists each rank's
    threads at exit."""
    log = (twenty.parent / "twenty.log").read_text()
    at_exit = dict(re.findall(r"rank (\d+): threads at exit: (\[[^\]]*\])", log))
    assert sorted(at_exit) == ["0", "1"], log[-3000:]
    for rank, threads in at_exit.items():
        assert "gloo" not in threads, f"rank {rank}: {threads}"


def _scribble(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 4096] = os.urandom(len(raw[middle : middle + 4096]))
    path.write_bytes(bytes(raw))


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.timeout(600)
def test_checkpoints_are_never_overwritten_by_a_run_that_did_not_load_them(
    clean: Path, twenty: Path, tmp_path: Path
):
    """Without latest.json, --resume continues from the newest checkpoint that verifies; a
    fresh run in that directory refuses, and leaves every checkpoint file as it was."""
    run_dir = shutil.copytree(twenty, tmp_path / "run")
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "latest.json").unlink()
    before = _digests(checkpoints)
    refused = _job(run_dir, "--train.steps=30", *EVERY_10)
    assert refused.returncode != 0
    assert "holds checkpoints (2 checkpoint(s), steps 10 to 20) that this run" in refused.stderr
    assert _digests(checkpoints) == before
    log = _ok(_job(run_dir, "--train.steps=30", *EVERY_10, "--resume"))
    assert "latest.json is missing" in log and "resumed from the checkpoint of step 20" in log
    _assert_equal(_params(run_dir, 30, tmp_path), _params(clean, 30, tmp_path))


@pytest.mark.timeout(600)
def test_a_corrupted_checkpoint_falls_back_to_the_previous_one(
    clean: Path, twenty: Path, tmp_path: Path
):
    run_dir = shutil.copytree(twenty, tmp_path / "run")
    _scribble(run_dir / "checkpoints" / "step_00000020" / "__1_0.distcp")  # rank 1's part
    log = _ok(_job(run_dir, "--train.steps=30", *EVERY_10, "--resume"))
    assert "the checkpoint of step 20 failed verification" in log
    assert "__1_0.distcp does not match its SHA-256" in log
    assert "falling back to the checkpoint of step 10" in log
    assert "resumed from the checkpoint of step 10" in log
    assert (run_dir / "checkpoints" / "step_00000020.corrupt").is_dir()
    _assert_equal(_params(run_dir, 30, tmp_path), _params(clean, 30, tmp_path))

    # Nothing left that verifies: one line, and the job does not start over.
    for step in (10, 20, 30):  # 20 was written again, from 10
        _scribble(run_dir / "checkpoints" / f"step_{step:08d}" / "__0_0.distcp")
    done = _job(run_dir, "--train.steps=40", *EVERY_10, "--resume")
    assert done.returncode != 0
    assert f"CheckpointError: no checkpoint in {run_dir / 'checkpoints'} verifies" in done.stderr
    assert "]: Traceback" not in done.stderr  # no rank's traceback (torchrun adds its own)


@pytest.mark.timeout(600)
def test_a_rank_killed_while_saving_never_becomes_latest(clean: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    log = _ok(
        _job(run_dir, "--train.steps=30", *EVERY_10, "--resume", restarts=1, FAULT_SAVE="20:1")
    )
    assert "fault injection: rank 1 exits while saving step 20" in log
    assert "resumed from the checkpoint of step 10" in log  # not the half-saved 20
    _assert_equal(_params(run_dir, 30, tmp_path), _params(clean, 30, tmp_path))


@pytest.mark.timeout(300)
def test_a_bad_batch_stops_the_job_with_its_name(tmp_path: Path):
    done = _job(tmp_path / "run", "--train.steps=20", FAULT_BATCH=f"{BAD_STEP}:1:nan")
    assert done.returncode != 0
    assert (
        f"InvalidBatchError: training batch {BAD_STEP} of rank 1 is bad: its dense features "
        "hold NaN or infinite values" in done.stderr
    ), done.stderr[-3000:]
    assert 'on_bad_batch = "skip"' in done.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("kind", "policy", "counter"),
    [("nan", "--data.on_bad_batch=skip", "bad_batches"),
     ("nanloss", "--train.on_nonfinite=skip", "nonfinite_skipped")],
    ids=["bad-batch-skipped", "nonfinite-loss-skipped"],
)  # fmt: skip
def test_a_skipped_batch_trains_on_as_if_never_seen(
    without_bad_batch: Path, tmp_path: Path, kind: str, policy: str, counter: str
):
    run_dir = tmp_path / "run"
    log = _ok(
        _job(run_dir, "--train.steps=30", *EVERY_10, policy, FAULT_BATCH=f"{BAD_STEP}:1:{kind}")
    )
    assert "skipped" in log
    records = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get(counter) or 0 for r in records) == 1, records
    _assert_equal(_params(run_dir, 30, tmp_path), _params(without_bad_batch, 29, tmp_path))
