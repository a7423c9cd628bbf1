"""How long `python -m distcache plan` takes, as a user runs it, by stage; optionally in turns
with the same command at another commit, and beside a fixed reference workload that says how
fast this machine is today.

Each run is a fresh `python -m distcache plan ARGS` process (interpreter start, imports,
solve, printing), timed from the outside; the solver's debug log gives its stages (menus,
starts, local search, hot rows, explanations), and the md5 of what the command printed says
whether two commits planned alike (a speed change that should not change plans must keep it).
With `--base REV`, REV's `distcache/` (`git archive`) runs the same command in turns with this
tree's, alternating which goes first, so both see the same moments of a shared machine; the
ratio is taken per pair. Between pairs, a fixed workload of small Python and numpy operations
(the planner's kind of work) is timed: its seconds compare days on a machine whose speed
varies (on the 2-core machine of this project one command took 2.8 s one day and 5-7 s on
others, the code unchanged).

Bytecode (`--bytecode`): by default each variant's first run is untimed and writes the bytecode
of every module it imports into a folder of the variant's own (PYTHONPYCACHEPREFIX), which the
timed runs read, as a user's second run finds the bytecode Python wrote on the first (its
default). `--bytecode none` times runs that compile every module of distcache from source: what
`time python -m distcache plan` measures in a shell that sets PYTHONDONTWRITEBYTECODE=1, as this
project's development machine does (about 0.15 s more a run there).

Usage::

    python benchmarks/planner_speed.py --runs 3 --json benchmarks/results/planner_speed_cpu.json
    python benchmarks/planner_speed.py --base 0667e0a --runs 4 \\
        --plan-args "--preset criteo-terabyte --topology h200 --world-size 16 --device-memory 8GB"
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARGS = "--preset synthetic:tables=1000 --world-size 128 --device-memory 16GB"
# The solver's debug lines (`solver.solve`) and the stage each one ends.
STAGES = (
    ("menus", re.compile(r"solve: menus of \d+ tables in ([\d.]+) s")),
    ("starts", re.compile(r"solve: \d+ starts by ([\d.]+) s")),
    ("search", re.compile(r"solve: improved by ([\d.]+) s")),
    ("hot_rows", re.compile(r"solve: hot rows by ([\d.]+) s")),
    ("explain", re.compile(r"solve: explained by ([\d.]+) s")),
)
# Run in the child: the solver's debug log to stderr, then the command itself.
_CHILD = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format='%(message)s')\n"
    "logging.getLogger('distcache.planner.solver').setLevel(logging.DEBUG)\n"
    "from distcache.__main__ import main\n"
    "sys.exit(main(['plan', *sys.argv[1:]]))\n"
)


def run_plan(args: list[str], code: Path, pycache: Path | None = None) -> dict:
    """One `plan` process with `args`, importing distcache from `code` (its bytecode read from
    and written to `pycache`; None: as this shell's environment says): its wall seconds, the
    md5 of its output and its stages' seconds (each stage's own, not cumulative)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    began = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], cwd=code, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - began
    if run.returncode != 0:
        raise SystemExit(f"plan {shlex.join(args)} failed in {code}:\n{run.stderr[-2000:]}")
    stages, before = {}, 0.0
    for name, pattern in STAGES:
        found = pattern.search(run.stderr)
        if found:
            stages[name] = float(found.group(1)) - before
            before = float(found.group(1))
    return {
        "wall_s": wall,
        "md5": hashlib.md5(run.stdout.encode()).hexdigest(),
        "solve_s": before,
        "stages_s": stages,
    }


def reference_s(repeats: int = 3) -> dict[str, float]:
    """Seconds (least of `repeats`) of two fixed workloads of the planner's kind: a pure
    Python loop of float arithmetic and dict lookups (3 M iterations), and 100,000 small
    numpy operations on [20, 128] arrays. Same code every day: its change is the machine's."""
    table = {i: float(i) for i in range(1000)}
    a = np.ones((20, 128))

    def python() -> None:
        total = 0.0
        for i in range(3_000_000):
            total += table[i % 1000] * 1.0001
        assert total > 0

    def numpy_ops() -> None:
        b = a
        for _ in range(50_000):
            b = np.maximum(b * 1.0000001, a)
        assert b.shape == a.shape

    out = {}
    for name, work in (("python_s", python), ("numpy_s", numpy_ops)):
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            work()
            times.append(time.perf_counter() - began)
        out[name] = min(times)
    return out


def base_tree(rev: str, into: Path) -> Path:
    """`rev`'s distcache/ unpacked under `into` (the base's code, nothing else)."""
    archive = subprocess.run(
        ["git", "archive", rev, "distcache"], cwd=ROOT, capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"--base {rev}: git archive failed: {archive.stderr.decode()[-500:]}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def summarize(name: str, runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    stages = {s: statistics.median(r["stages_s"].get(s, 0.0) for r in runs) for s, _ in STAGES}
    return {
        "variant": name,
        "runs": len(runs),
        "median_s": statistics.median(walls),
        "min_s": min(walls),
        "max_s": max(walls),
        "md5": sorted({r["md5"] for r in runs}),
        **{f"{s}_s": v for s, v in stages.items()},
        "all": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--plan-args", default=DEFAULT_ARGS, help="the plan command's arguments")
    ap.add_argument("--runs", type=int, default=3, help="runs of each variant")
    ap.add_argument("--base", default=None, help="a commit to run in turns with this tree")
    ap.add_argument(
        "--bytecode",
        choices=("cached", "none"),
        default="cached",
        help="cached: bytecode written by an untimed first run and read by the timed ones (a "
        "user's second run); none: every run compiles distcache (see above)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    plan_args = shlex.split(args.plan_args)
    with tempfile.TemporaryDirectory(prefix="planner_speed_") as tmp:
        variants = {"head": ROOT}
        if args.base:
            variants["base"] = base_tree(args.base, Path(tmp))
        pycache = {name: None for name in variants}
        if args.bytecode == "cached":
            for name in variants:  # the untimed first run, which writes the bytecode
                pycache[name] = Path(tmp) / f"pycache_{name}"
                run_plan(plan_args, variants[name], pycache[name])
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        references = []
        for i in range(args.runs):
            references.append(reference_s())
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for name in order:
                runs[name].append(run_plan(plan_args, variants[name], pycache[name]))
                print(f"run {i + 1} {name}: {runs[name][-1]['wall_s']:.2f} s", file=sys.stderr)
    rows = [summarize(name, r) for name, r in runs.items()]
    if args.base:
        pairs = [h["wall_s"] / b["wall_s"] for h, b in zip(runs["head"], runs["base"], strict=True)]
        rows[0]["x_base_pairs"] = pairs
        rows[0]["x_base_median"] = statistics.median(pairs)
        rows[0]["same_output_as_base"] = rows[0]["md5"] == rows[1]["md5"]
    reference = {k: statistics.median(r[k] for r in references) for k in references[0]}
    columns = [("variant", "variant"), ("median_s", "median s"), ("min_s", "min s")]
    columns += [(f"{s}_s", s) for s, _ in STAGES] + [("x_base_median", "x base (pairs)")]
    print_table(rows, columns)
    print(
        f"reference workload (this machine today): python {reference['python_s']:.3f} s, "
        f"numpy {reference['numpy_s']:.3f} s; outputs: "
        + ", ".join(f"{r['variant']} {'/'.join(m[:8] for m in r['md5'])}" for r in rows)
    )
    config = {
        "plan_args": plan_args,
        "runs": args.runs,
        "base": args.base,
        "bytecode": args.bytecode,
        "shell_sets_PYTHONDONTWRITEBYTECODE": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
        "reference": reference,
        "references": references,
    }
    write_json(args.json, config, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
