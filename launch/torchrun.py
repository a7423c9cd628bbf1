"""torchrun for distcache's job: a failed job ends in one line per failed rank, no traceback.

Each rank of `python -m distcache train` prints its own error in one line (`distcache train:
ErrorType: message`). For the same failure torchrun adds a log line, its own traceback and a
failure block that points at error files the job does not write, 20 lines or more. This runs
torchrun (`torch.distributed.run`, same arguments) and ends a failed job with one line naming
the ranks that failed and how instead.

When the job is `-m distcache train`, its arguments are checked first, in this process
(`python -m distcache check`: each mistake named in one line, before any worker starts; one
interpreter and one import of torch fewer than checking in a process of its own).

`--debug` anywhere on the command line (the job's ranks receive it too, and then print their
tracebacks) runs torchrun unchanged, its own output included. `launch/torchrun.sh` calls this.

Usage::

    python launch/torchrun.py --standalone --nproc-per-node=2 -m distcache train --config X
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported after the job's check, which a bad config ends sooner without
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# torchrun's log lines about a failed worker group that the last line names again.
_REPEATED = ("failed (exitcode: ", "Sending process ")


class _DropRepeated(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_REPEATED)


def failure_line(err: ChildFailedError) -> str:
    """One line for torchrun's `ChildFailedError`: which ranks failed, with which exit code
    or signal."""
    how = [
        f"rank {rank} ("
        + (f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}")
        + ")"
        for rank, f in sorted(err.failures.items())
    ]
    return (
        f"launch/torchrun.sh: the job failed on {', '.join(how)}; each rank's error is above "
        "(--debug shows tracebacks)"
    )


def job_arguments(argv: list[str]) -> list[str] | None:
    """The arguments of the job `argv` launches when it is `-m distcache train`, else None."""
    for i in range(len(argv) - 2):
        if argv[i : i + 3] == ["-m", "distcache", "train"]:
            return argv[i + 3 :]
    return None


def main(argv: list[str]) -> int:
    job = job_arguments(argv)
    if job is not None:
        # The copy of distcache the ranks run (`-m distcache` from the repository's root).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from distcache.__main__ import main as distcache_main

        status = distcache_main(["check", *job])
        if status:  # ended at once, as `python -m distcache` ends (torch is not finalized)
            sys.stderr.flush()
            os._exit(status)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "--debug" in argv:
        torchrun.main(argv)
        return 0
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropRepeated())
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as err:
        print(failure_line(err), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
