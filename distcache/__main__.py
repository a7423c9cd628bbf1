"""`python -m distcache COMMAND`: the project's command-line entry points.

Each command is a `main(argv) -> int` in its own module, imported only when run. distcache's own
errors (`DistcacheError`) print one line, `distcache COMMAND: ErrorType: message`, and exit 1;
`--debug` anywhere on the command line shows the traceback instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from distcache.errors import DistcacheError

# name -> (module, function, one-line help)
COMMANDS = {
    "demo": ("distcache.job.demo", "main", "the cache at work on a small synthetic job"),
    "train": ("distcache.train", "main", "train a DLRM from a TOML config (see configs/)"),
    "check": (
        "distcache.job.check",
        "check_main",
        "check train's arguments, config and inputs without training",
    ),
    "plan": ("distcache.tools.plan_cli", "plan_main", "plan a workload on a topology; write JSON"),
    "compare": (
        "distcache.tools.plan_cli",
        "compare_main",
        "compare distcache's plan with TorchRec's planner and baselines",
    ),
    "calibrate": (
        "distcache.tools.calibrate",
        "main",
        "measure this machine and write a topology JSON",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:10s} {text}" for name, (_, _, text) in COMMANDS.items())
        print(
            f"usage: python -m distcache COMMAND [ARGS] [--debug]\n\ncommands:\n{usage}",
            file=sys.stderr,
        )
        return 2
    debug = "--debug" in argv  # a full traceback for distcache's own errors
    argv = [a for a in argv if a != "--debug"]
    module, function, _ = COMMANDS[argv[0]]
    try:
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    except DistcacheError as err:
        if debug:
            raise
        # The message names what is wrong and what is allowed: the traceback adds nothing.
        # One write, so that the lines of ranks failing together do not interleave.
        sys.stderr.write(f"distcache {argv[0]}: {type(err).__name__}: {err}\n")
        return 1


def _exit(status: int) -> None:
    """End the process without finalizing the interpreter, once everything is written.

    torch keeps the default gloo group alive past `destroy_process_group` once `torch._dynamo`
    is imported (an optimizer's construction imports it): its worker threads outlive the job,
    and one still releasing a finished collective's tensors while the interpreter finalizes
    needs the GIL and aborts the process ("terminate called without an active exception"),
    seen about once in 20 two-rank jobs on a loaded machine, after a successful run (a gdb
    backtrace of the core: `ProcessGroupGloo::runLoop` -> `~AsyncAllgatherWork` ->
    `TensorImpl::decref_pyobject` -> `take_gil` during `Py_FinalizeEx`). distcache's files
    are closed by then (metrics lines, checkpoints); logs and stdio are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _exit(main())
