"""The README and the documents it links to: their runnable examples run (a newcomer copies
them first), their relative links lead to files of the repository, and the README stays short."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("**/*.md"))
MARKDOWN = [README, *DOCS, *sorted((ROOT / "benchmarks").glob("**/README.md"))]
RUNNABLE = r"```python\n(# runnable.*?)```"
README_MAX_LINES = 400  # a newcomer reads it in five minutes; the rest lives in docs/


def test_runnable_blocks_execute(capsys):
    """Every `# runnable` block of the README and of docs/, in one process, in that order."""
    blocks = [
        (path, block)
        for path in [README, *DOCS]
        for block in re.findall(RUNNABLE, path.read_text(), flags=re.S)
    ]
    names = {path.relative_to(ROOT).as_posix() for path, _ in blocks}
    assert {"README.md", "docs/engine.md"} <= names, "the TorchRec and the engine examples"
    for path, block in blocks:
        exec(compile(block, str(path), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "{'user+item': 0}" in out  # the engine alone: no critical-path miss
    assert "critical-path misses 0" in out  # the TorchRec model under the pipeline


def _relative_links(text: str) -> list[str]:
    """The targets of `[text](target)` links outside code, less web links and pure #anchors."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [t.split()[0] for t in re.findall(r"\]\(([^)]+)\)", text)]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_files_of_the_repository(page):
    links = _relative_links(page.read_text())
    missing = [t for t in links if not (page.parent / t.split("#")[0]).resolve().exists()]
    outside = [t for t in links if ROOT not in (page.parent / t.split("#")[0]).resolve().parents]
    assert not missing, f"{page.name}: links to no file: {missing}"
    assert not outside, f"{page.name}: links out of the repository: {outside}"


def test_link_finder_sees_what_it_should():
    text = "[a](docs/a.md) [b](https://x.org) [c](#top) [d](b.md#part) `[e](no.md)`"
    assert _relative_links(text) == ["docs/a.md", "b.md#part"]


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move details to docs/"


def _torchrec_block() -> str:
    (block,) = [
        b
        for b in re.findall(RUNNABLE, README.read_text(), flags=re.S)
        if "torchrun" in b.splitlines()[0]
    ]
    return block


@pytest.mark.timeout(300)
def test_the_torchrec_example_prints_no_warning_the_user_did_not_cause(tmp_path):
    """As a newcomer runs it, one process: its line, and no warning of TorchRec's or torch's
    own (`distcache.quiet`), on stdout or stderr."""
    script = tmp_path / "example.py"
    script.write_text(_torchrec_block())
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stderr == ""
    assert done.stdout.startswith("hit rate ") and done.stdout.count("\n") == 1, done.stdout


@pytest.mark.timeout(300)
def test_the_torchrec_example_runs_unchanged_on_two_ranks(tmp_path):
    """The same block under torchrun: each rank plans for a world of 2 and trains its part."""
    script = tmp_path / "example.py"
    script.write_text(
        _torchrec_block()
        .replace(
            "dist.destroy_process_group()",
            'print(f"rank {dist.get_rank()} of {dist.get_world_size()}, '
            'ranks in the plan: {sorted(ranks)}")\ndist.destroy_process_group()',
        )
        .replace(
            "plan = planner.collective_plan(model, [sharder], dist.group.WORLD)",
            "plan = planner.collective_plan(model, [sharder], dist.group.WORLD)\n"
            "ranks = {r for m in plan.plan.values() for p in m.values() for r in p.ranks}",
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.count("critical-path misses 0") == 2, done.stdout
    assert "warn" not in done.stderr.lower(), done.stderr[-3000:]  # none on either rank
    for rank in (0, 1):  # both ranks, in one plan over both ranks
        assert f"rank {rank} of 2, ranks in the plan: [0, 1]" in done.stdout, done.stdout
