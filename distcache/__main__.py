"""`python -m distcache COMMAND`: the project's command-line entry points.

Each command is a `main(argv) -> int` in its own module, imported only when run.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help)
COMMANDS = {
    "demo": ("distcache.job.demo", "main", "the cache at work on a small synthetic job"),
    "train": ("distcache.train", "main", "train a DLRM from a TOML config (see configs/)"),
    "plan": ("distcache.job.plan_cli", "plan_main", "plan a workload on a topology; write JSON"),
    "compare": (
        "distcache.job.plan_cli",
        "compare_main",
        "compare distcache's plan with TorchRec's planner and baselines",
    ),
    "calibrate": (
        "distcache.job.calibrate",
        "main",
        "measure this machine and write a topology JSON",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:10s} {text}" for name, (_, _, text) in COMMANDS.items())
        print(f"usage: python -m distcache COMMAND [ARGS]\n\ncommands:\n{usage}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
