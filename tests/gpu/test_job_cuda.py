"""The training job on one GPU (issue 36, item 2): `configs/criteo_terabyte_synthetic.toml`
scaled down, launched by torchrun, trains with the cache's counters in its metrics, writes
checkpoints, and a run killed after a checkpoint resumes to the same losses and final
parameters as an uninterrupted one, bitwise.

The job is the same on CPU (tests/distributed/test_train.py runs it on 2 CPU ranks); set
`DEVICE = "cpu"` in a copy of this module to check its logic without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.gpu.common import CUDA_REASON
from tests.unit.job.test_checkpoint import resumed_and_whole

DEVICE = "cuda"
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "criteo_terabyte_synthetic.toml"
SCALED = [
    f"--train.device={DEVICE}",
    "--data.preset=criteo-terabyte:scale=2000",  # 94 k rows: seconds, yet most tables cached
    "--data.batch_size=512",
    "--train.steps=30",
    "--train.log_every=10",
    "--train.eval_every=0",
    "--checkpoint.every=10",
    "--train.progress_bar=false",
    "--resume",
]

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)


def _job(run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, "NPROC": "1", "CONFIG": str(CONFIG)}
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    return subprocess.run(
        [str(ROOT / "launch" / "torchrun.sh"), f"--run.dir={run_dir}", *SCALED],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=400,
    )


def _train_records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


def _final(run_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / "step_00000030", out)
    flat: dict[str, torch.Tensor] = {}

    def walk(state, prefix: str = "") -> None:  # noqa: ANN001
        if isinstance(state, dict):
            for key, value in state.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(state, torch.Tensor):
            flat[prefix] = state

    walk(torch.load(out, weights_only=False))
    return flat


@pytest.mark.timeout(900)
def test_the_job_trains_checkpoints_and_resumes_bitwise(tmp_path):
    whole = _job(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    records = _train_records(tmp_path / "whole")
    assert sorted(records) == [10, 20, 30]
    for r in records.values():
        assert r["samples_per_s"] > 0 and 0 < r["hit_rate"] < 1 and r["loads"] > 0, r
        assert r["critical_misses"] == 0, r
    killed = _job(
        tmp_path / "killed", MAX_RESTARTS="1", DISTCACHE_CRASH_AT_STEP="15",
        DISTCACHE_CRASH_RANK="0",
    )  # fmt: skip
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed from the checkpoint of step 10" in killed.stdout + killed.stderr
    resumed = _train_records(tmp_path / "killed")
    for step in (20, 30):  # after the resume: the same losses
        assert resumed[step]["loss"] == records[step]["loss"], step
    final = {name: _final(tmp_path / name, tmp_path) for name in ("whole", "killed")}
    assert final["whole"].keys() == final["killed"].keys()
    assert any("embedding_bags" in k for k in final["whole"])
    for key, value in final["whole"].items():
        assert torch.equal(value, final["killed"][key]), key


def test_stochastically_rounded_half_rows_resume_bitwise(tmp_path):
    """FBGEMM's default on CUDA, stochastic rounding of fp16 rows, draws from the GPU's
    generator: a checkpoint holds its state, so a resumed run lands where an uninterrupted one
    does, bitwise."""
    resumed, whole = resumed_and_whole(tmp_path, DEVICE)
    assert not torch.equal(whole, torch.ones_like(whole))
    assert torch.equal(resumed, whole)
