"""`python -m distcache demo` runs as a newcomer runs it (a subprocess, a short job) and says
what the caches did, trained equal to the same training without a cache."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from distcache.job.demo import main

ROOT = Path(__file__).resolve().parents[3]


def test_demo_runs_and_matches_the_uncached_model() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "distcache", "demo", "--steps", "20"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    out = done.stdout  # the report is logged: stdout and stderr together
    assert re.search(r"step\s+20\s+loss \d", out), out[-2000:]
    # Equal within float rounding: FBGEMM's kernel (the default) sums a row's gradient over
    # the batch before its step, the reference's sparse SGD steps id by id.
    difference = re.search(r"max \|difference\| = (\S+)", out)
    assert difference and float(difference.group(1)) < 1e-5, out[-2000:]
    misses = [int(m) for m in re.findall(r"\| critical-path misses (\d+)", out)]
    assert misses and all(m == 0 for m in misses), out[-2000:]
    assert re.search(r"lookahead loads\s+[\d,]+\s+\(\d", out), out[-2000:]


@pytest.mark.parametrize("flag", ["--steps", "--batch-size"])
def test_a_count_below_one_is_one_line_naming_its_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="2"):
        main([flag, "0"])
    assert f"argument {flag}: expected an int >= 1, got '0'" in capsys.readouterr().err
