"""torchrun for distcache's job: a failed job ends in one line per failed rank, no traceback.

Each rank of `python -m distcache train` prints its own error in one line (`distcache train:
ErrorType: message`). For the same failure torchrun adds a log line, its own traceback and a
failure block that points at error files the job does not write, 20 lines or more. This runs
torchrun (`torch.distributed.run`, same arguments) and ends a failed job with one line naming
the ranks that failed and how instead.

`--debug` anywhere on the command line (the job's ranks receive it too, and then print their
tracebacks) runs torchrun unchanged, its own output included. `launch/torchrun.sh` calls this.

Usage::

    python launch/torchrun.py --standalone --nproc-per-node=2 -m distcache train --config X
"""

from __future__ import annotations

import logging
import sys

from torch.distributed import run as torchrun
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


def main(argv: list[str]) -> int:
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
