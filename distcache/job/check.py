"""`python -m distcache check`: what a training job can know before any process starts (its
input files, packages, devices and run folder), every mistake in one line; `launch/torchrun.sh`
runs it before it starts any worker, and `python -m distcache train` before its process group.

Example::

    check_inputs(parse_args(["--config", "configs/tiny_cpu.toml"]))  # raises on a mistake
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from distcache.errors import DistcacheConfigError
from distcache.job.config import JobConfig, fail_with, parse_args, plan_topology


def check_inputs(config: JobConfig) -> None:
    """Errors a job can know before any process starts (missing files, packages, devices),
    every one of them in one `DistcacheConfigError`."""
    problems = [
        f"[data] path {path!r} does not exist"
        for path in config.data.paths + config.data.eval_paths
        if not Path(path).exists()
    ]
    planner = config.plan.planner
    if planner.endswith(".json") and not Path(planner).is_file():
        problems.append(f"[plan] planner file {planner!r} does not exist")
    try:
        plan_topology(config, world_size=1)
    except DistcacheConfigError as err:
        problems.append(str(err))
    if config.cache.hot_rows:
        problems.append(
            f"[cache] hot_rows = {list(config.cache.hot_rows)[:8]} is invalid: hot rows are per "
            "table, and [cache] is every table's; the 'distcache' planner replicates hot rows "
            "itself (synthetic data): leave it []"
        )
    if config.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append(
            "[train] tensorboard = true needs the tensorboard package: pip install tensorboard"
        )
    if config.train.device == "cuda" and not torch.cuda.is_available():
        problems.append("[train] device = 'cuda' but CUDA is not available here")
    run_dir = Path(config.run.dir)
    there = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
        problems.append(
            f"[run] dir {config.run.dir!r} cannot be written: {str(there)!r} is not a "
            "writable folder"
        )
    fail_with(problems)


def check_main(argv: list[str]) -> int:
    """`python -m distcache check`: check a training job's command line (the arguments of
    `python -m distcache train`) and its inputs without starting it; silent when they are
    fine. `launch/torchrun.sh` runs it before it starts any worker."""
    check_inputs(parse_args(argv, "check"))
    return 0
