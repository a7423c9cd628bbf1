"""Parse command lines with their programs' own argument parsers, and stop there.

usage: python tests/argv_check.py COMMANDS.json

COMMANDS.json holds a list of argv lists, each `[script.py, args...]` or `[-m, module, args...]`.
Each program runs as `__main__` until its first `ArgumentParser.parse_args` returns (so flags,
types and choices are checked, nothing else runs). Prints one line per command that its parser
refused, with argparse's message, and exits 1 if any was. (tests/test_gpu_session.py: the GPU
session's commands, checked here before they cost device time.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys


class _Parsed(Exception):
    """Raised when a parser accepted its command line."""


def _stop_after_parsing() -> None:
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        parse(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]


def check(argv: list[str]) -> str | None:
    """None if `argv`'s program accepts its arguments, else why not."""
    saved = sys.argv
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[:2] == ["-m", "distcache"]:  # (its __main__ ends the process: os._exit)
                from distcache.__main__ import main

                code = main(argv[2:])
                if code:
                    return f"exit {code}: {_last_line(err)}"
            elif argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
    except _Parsed:
        return None
    except SystemExit as exit_:
        return f"exit {exit_.code}: {_last_line(err)}"
    finally:
        sys.argv = saved
    return "ran to its end without parsing its arguments"


def _last_line(stream: io.StringIO) -> str:
    return (stream.getvalue().strip().splitlines() or [""])[-1]


def main() -> int:
    _stop_after_parsing()
    refused = 0
    for argv in json.loads(open(sys.argv[1]).read()):
        why = check(argv)
        if why is not None:
            refused += 1
            print(f"{' '.join(argv)}\n    {why}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
