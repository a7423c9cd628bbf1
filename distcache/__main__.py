"""`python -m distcache COMMAND`: the project's command-line entry points."""

from __future__ import annotations

import sys

COMMANDS = {"demo": "the cache at work on a small synthetic job"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:8s} {text}" for name, text in COMMANDS.items())
        print(f"usage: python -m distcache COMMAND [ARGS]\n\ncommands:\n{usage}", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from distcache.demo import main as demo

        return demo(rest)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
