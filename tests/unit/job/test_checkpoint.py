"""`Checkpointer` in one process (no process group): pruning with `keep_last`, and one clear
error naming the path for a corrupt `latest.json` or a missing `.metadata`. The multi-rank
resume (bitwise equal to an uninterrupted run) is in tests/distributed/test_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distcache import CheckpointError
from distcache.job.checkpoint import LATEST, Checkpointer


def _saved(
    tmp_path: Path, steps: list[int], keep_last: int
) -> tuple[Checkpointer, torch.nn.Linear]:
    model = torch.nn.Linear(3, 2)
    checkpoints = Checkpointer(tmp_path, every=1, keep_last=keep_last)
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        checkpoints.save(step, model)
    return checkpoints, model


def test_keep_last_deletes_all_but_the_newest(tmp_path: Path) -> None:
    checkpoints, _ = _saved(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert checkpoints.latest() == 5
    restored = torch.nn.Linear(3, 2)
    assert checkpoints.restore(restored) == 5
    assert torch.equal(restored.weight, torch.full((2, 3), 5.0))


def test_keep_last_zero_keeps_every_checkpoint(tmp_path: Path) -> None:
    _saved(tmp_path, [1, 2, 3], keep_last=0)
    assert len(list(tmp_path.glob("step_*"))) == 3


@pytest.mark.parametrize("text", ["{not json", '{"path": "step_00000001"}', '{"step": -1}'])
def test_a_corrupt_latest_json_is_named(tmp_path: Path, text: str) -> None:
    checkpoints, model = _saved(tmp_path, [1], keep_last=0)
    (tmp_path / LATEST).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{tmp_path / LATEST} is corrupt"):
        checkpoints.restore(model)


def test_a_missing_metadata_file_is_named(tmp_path: Path) -> None:
    checkpoints, model = _saved(tmp_path, [1, 2], keep_last=0)
    (tmp_path / "step_00000002" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000002/\.metadata is missing"):
        checkpoints.restore(model)


def test_resume_says_where_it_starts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 2)
    with caplog.at_level("INFO", logger="distcache.job.checkpoint"):
        assert Checkpointer(tmp_path).restore(model) is None
        assert f"no checkpoint in {tmp_path}: starting from step 0" in caplog.text
        checkpoints, _ = _saved(tmp_path, [7], keep_last=0)
        assert checkpoints.restore(model) == 7
    assert "resumed from the checkpoint of step 7" in caplog.text
    assert "resharded" not in caplog.text  # saved and restored by one process
    (tmp_path / LATEST).write_text('{"step": 7, "path": "step_00000007"}')  # no world size
    caplog.clear()
    with caplog.at_level("INFO", logger="distcache.job.checkpoint"):
        assert checkpoints.restore(model) == 7
    assert "resumed from" in caplog.text and "resharded" not in caplog.text


def test_resume_require_refuses_to_start_over(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"--resume=require: no checkpoint in .*latest"):
        Checkpointer(tmp_path / "none").restore(torch.nn.Linear(3, 2), require=True)
