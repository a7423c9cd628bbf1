"""Shared by the benchmarks: the machine description and the JSON result file."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from distcache.tools.machine import cpu_model


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    info: dict[str, object] = {
        "platform": platform.platform(),
        "processor": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def commit() -> str:
    """The commit measured, with "+dirty" when the tree has uncommitted changes (other than
    under benchmarks/results/ and to Markdown files, which measure nothing)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    # Results written by an earlier benchmark of the same run are outputs, not changes to code.
    outputs, docs = ":!benchmarks/results", ":!*.md"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", outputs, docs)
    return head + ("+dirty" if changed else "")


SOURCES = ("distcache/**/*.py", "benchmarks/*.py")


def source_digest(root: Path | None = None) -> str:
    """SHA-256 (16 hex digits) of the code a result measured: every file of `SOURCES`, by path
    and content. It names the code where the commit cannot (a copy whose git metadata is stale
    or absent, as on the GPU machine); `python benchmarks/_common.py` prints it for a checkout."""
    root = root or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    files = sorted({f for pattern in SOURCES for f in root.glob(pattern) if f.is_file()})
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        digest.update(f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def write_json(path: str | None, config: dict, results: list[dict]) -> None:
    """Write the full config, the machine and the results, so a result can be re-run."""
    if not path:
        return
    payload = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit(),
        "source_sha256": source_digest(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "config": config,
        "results": results,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Print rows as an aligned table; columns are (key, header)."""
    cells = [[h for _, h in columns]] + [[_fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for n, line in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)


def ratio_interval(
    base_s: list[float], other_s: list[float], level: float = 0.9, resamples: int = 2000
) -> tuple[float, float]:
    """The `level` interval of sum(base_s) / sum(other_s) (throughput of `other` over `base`)
    by a paired bootstrap of the steps: step i of both, timed in the same round, is resampled
    together, so that the machine's drift, shared by both, cancels; a fixed seed keeps a
    report reproducible from its step times."""
    import numpy as np

    base, other = np.asarray(base_s, dtype=np.float64), np.asarray(other_s, dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, base.size, size=(resamples, base.size))
    ratios = base[picks].sum(axis=1) / other[picks].sum(axis=1)
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


if __name__ == "__main__":
    print(source_digest())
