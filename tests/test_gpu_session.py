"""benchmarks/gpu_session.sh, checked here before it costs device time: every stage's commands
are accepted by their programs' own argument parsers, and the tests they name exist."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
PY = "__python__"  # the session's $PY, recognized in the recorded commands


def _stages() -> list[str]:
    return re.findall(r"^\s+(\w+)\) stage_\w+ ;;$", SCRIPT.read_text(), flags=re.M)


def _commands(stage: str, tmp_path: Path) -> list[list[str]]:
    """The stage's steps as argv lists, recorded by the script's check mode (nothing runs)."""
    record = tmp_path / f"{stage}.txt"
    env = {"PATH": "/usr/bin:/bin", "GPU_SESSION_CHECK": str(record), "PY": PY}
    run = subprocess.run(
        ["bash", str(SCRIPT), stage],
        cwd=ROOT,
        env={**env, "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = record.read_text().splitlines() if record.exists() else []
    out = []
    for line in lines:
        argv = shlex.split(line)
        if argv[:2] == ["bash", "-c"]:  # a step of several commands
            out += [shlex.split(part) for part in argv[2].split(";")]
        else:
            out.append(argv)
    return [argv for argv in out if argv]


def test_every_stage_has_steps(tmp_path):
    stages = _stages()
    assert {"quick", "issue33a", "issue33b", "issue35", "issue36"} <= set(stages)
    for stage in stages:
        if stage == "unpack":  # unpacks .fbg for the next call: no step of its own
            continue
        assert _commands(stage, tmp_path), f"stage {stage} records no step"


@pytest.mark.timeout(300)
def test_every_command_of_every_stage_parses(tmp_path):
    programs, tests = [], []
    for stage in _stages():
        for argv in _commands(stage, tmp_path):
            if argv[0] in ("a=$?", "b=$?") or argv[0].startswith("exit"):
                continue  # the shell's bookkeeping between a step's commands
            assert argv[0] == PY, f"stage {stage}: a step runs {argv[0]!r}, not $PY"
            if argv[1:3] == ["-m", "pytest"]:
                tests += [a for a in argv[3:] if a.startswith("tests/") and "=" not in a]
            else:
                programs.append(argv[1:])
    missing = sorted({t for t in tests if not (ROOT / t.split("::")[0]).exists()})
    assert not missing, f"the session names tests that do not exist: {missing}"
    assert programs
    run = _argv_check(programs, tmp_path, timeout=280)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def test_the_check_finds_a_refused_flag(tmp_path):
    """The checker is not blind: a flag a script does not have is refused."""
    bad = ["benchmarks/engine_throughput.py", "--device", "cuda", "--no-such-flag"]
    good = ["benchmarks/engine_throughput.py", "--device", "cuda", "--quick"]
    run = _argv_check([good, bad], tmp_path, timeout=120)
    assert run.returncode == 1
    assert "--no-such-flag" in run.stdout and "--quick" not in run.stdout


def _argv_check(commands: list[list[str]], tmp_path: Path, timeout: int):
    """tests/argv_check.py run on `commands` (argv lists) in a subprocess."""
    path = tmp_path / "commands.json"
    path.write_text(json.dumps(commands))
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "argv_check.py"), str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
