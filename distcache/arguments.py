"""Argument types the package's commands share (argparse `type=` callables). Light: every
layer may import it, and a command before its heavy modules.

Example::

    parser.add_argument("--steps", type=positive_int, default=200)
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1, else one line naming what was given (argparse adds the flag's name)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value
