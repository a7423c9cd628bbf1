"""`python -m distcache`: distcache's own errors print one line and exit 1; `--debug` raises."""

from __future__ import annotations

from pathlib import Path

import pytest

from distcache import DistcacheConfigError
from distcache.__main__ import main

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.toml")


def test_a_config_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", CONFIG, "--cache.capacty=0.1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("distcache train: DistcacheConfigError: unknown key(s) ['capacty']")
    assert "allowed keys: ['capacity'" in err


def test_debug_shows_the_traceback() -> None:
    with pytest.raises(DistcacheConfigError, match="capacty"):
        main(["train", "--debug", "--config", CONFIG, "--cache.capacty=0.1"])


def test_no_command_prints_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "train" in capsys.readouterr().err


def test_check_is_silent_on_a_good_job_and_names_every_mistake(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What `launch/torchrun.sh` runs before it starts any worker."""
    assert main(["check", "--config", CONFIG, "--train.steps=5", "--resume"]) == 0
    assert capsys.readouterr() == ("", "")
    assert main(["check", "--config", CONFIG, "--cache.capacty=0.1", "--train.steps=0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distcache check: DistcacheConfigError: 2 ")
    assert "['capacty']" in err and "[train] steps = 0 is invalid" in err
    with pytest.raises(SystemExit, match="2"):  # argparse's usage and error, naming check
        main(["check", "--config", CONFIG, "train.steps=5"])
    assert "python -m distcache check: error: unrecognized" in capsys.readouterr().err
