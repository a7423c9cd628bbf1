"""The training loop's records: `metrics.jsonl` lines are strict JSON (a non-finite value is
null) and each run opens with a header record. The loop itself runs in
tests/distributed/test_train.py."""

from __future__ import annotations

import json
import math

from distcache.job.config import load_job_config
from distcache.job.trainer import metrics_line, run_header


def test_a_non_finite_value_is_written_as_null() -> None:
    line = metrics_line("train", {"step": 10, "loss": math.nan, "auc": math.inf, "hit": 0.5})
    assert json.loads(line) == {"kind": "train", "step": 10, "loss": None, "auc": None, "hit": 0.5}
    assert "NaN" not in line and "Infinity" not in line


def test_the_run_header_names_the_run_and_its_config() -> None:
    config = load_job_config(None)
    a, b = run_header(config, 0, 2), run_header(config, 30, 2)
    assert a["run_id"] != b["run_id"] and b["start_step"] == 30 and a["world_size"] == 2
    assert a["config_sha256"] == b["config_sha256"]
    other = load_job_config(None, ["--train.steps=7"])
    assert run_header(other, 0, 2)["config_sha256"] != a["config_sha256"]
    json.loads(metrics_line("run", a))
