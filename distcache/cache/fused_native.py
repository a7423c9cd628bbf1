"""The fused passes' kernels for CPU tensors, in C (`fused_native.c`), built on first use.

On CPU the scheduler's per-batch work as torch ops is a hundred-odd passes over arrays of a
batch's size, each reading its operands from memory again, and it costs the training thread
about as much as the lookups it serves (`benchmarks/throughput.py`). Triton's kernels
(`fused_kernels`) fuse those passes on a GPU; these are the same kernels for the host (one C
function each, the same arguments in the same order, the same values and state left behind),
less the three that select victims and the one that starts the running count of rows, which
the CPU does its own way, plus passes only the CPU fuses (`fused_native.c` lists them).
`tests/unit/cache/test_fused.py` runs them beside the torch ops and Triton's interpreter.
`fused.kernels` returns them for a CPU device, in a dict of Triton's names (and their own),
each indexed by a launch grid (ignored) as a Triton kernel is.

They are compiled with the system's C compiler (`$CC`, with any flags it holds, else `cc` or
`gcc`) into `$XDG_CACHE_HOME/distcache` (else `~/.cache/distcache`, else the temporary
directory), once per source and compiler: about a second. Where no compiler works, `load()`
returns None and says why in the log once; the caller then runs the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from distcache.errors import DistcacheError

_log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fused_native.c")

# Each kernel's arguments, as Triton's kernel takes them: a tensor's dtype (its data passed as
# a pointer), "i" for an int, "f" for a float, then its constexpr flags by name (passed as
# ints, in this order).
_I32, _I64, _U8, _F32 = torch.int32, torch.int64, torch.uint8, torch.float32
_SPECS: dict[str, tuple[tuple, tuple[str, ...]]] = {
    "enter": (
        (_I32, _I64, _I32, _I32, _I32, _I32, _I32, _I32, _I64, _I64, _I32, _U8, _I32)
        + ("i", "i", "i"),
        (),
    ),
    "look_up": ((_I64, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _I64, "i", "i"), ()),
    "evict": ((_I64, _I64, _I32, _U8, _I64, _U8, _U8, "i", "i"), ()),
    "place": (
        (_I64, _I32, _I32, _I64, _I64, _I64, _I32, _I32, _I64, _I32, _I32, _I64, _U8, _I64)
        + (None, "i", "i", "i"),  # `uses`: int32, or any tensor where USES is off
        ("USES",),
    ),
    "candidates": (
        (_I64, _I32, _I32, _I32, _I32, _I64, _I32, _I32, _I64, "i", "i", "i", "i", "i", "i"),
        ("SWEEP",),
    ),
    "route": (
        (_I64, _I64, _I64, _I64, _I64, _I64, _I64, "i", "i", "i", "i", "i"),
        ("CHECK", "PADDED"),
    ),
    # C only (`fused.enter`, `fused.select_counted`, `fused.candidates_free`, `fused.distinct`,
    # `fused.sgd`, `fused.pool`, `fused.check`, `fused.check_batch`, `fused.move`,
    # `fused.finish`, `fused.finish_whole`):
    "sort": ((_I32, _I32, _I64, _I32, _I32, _I64, "i", "i"), ()),
    "select": ((_I32, _I32, _I64, _I64, _I64, "i", "i", "i"), ()),
    "candidates_free": ((_I64, _I64, _I32, _I32, _I32, _I32, _I64, _I32, _I32) + ("i",) * 9, ()),
    "distinct": ((_I64, _I32, _I32, _I64, _I64, _I32, _U8, _I32, "i", "i"), ()),
    "sgd": (
        (_F32, _F32, _I64, _F32, _I64, "i", "i", "f", "i", "i"),
        ("POOLED", "WEIGHTED", "BATCH_MAJOR"),
    ),
    "pool": ((_F32, _I64, _I64, _F32, _F32, "i", "i", "i", "i"), ()),
    "check": ((_I64, _I64, _I64, _I64, _I64, "i", "i"), ()),
    "check_batch": ((None, _I64, _I64, _I64, _I64, "i", "i", "i", "i"), ()),
    "move": ((None, _I64, None, _I64, "i", "i"), ()),  # (rows of any dtype)
    "finish": (
        (_U8, _I64, _I32, _U8, _U8, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64)
        + (_I64, "i", "i", "i", "i"),
        (),
    ),
    "finish_whole": ((_U8, _I64, _I32, _I64, _I64, _I64, "i", "i"), ()),
}


class NativeKernel:
    """One C kernel, called as a Triton kernel is: `kernel[grid](*args, **constexprs)`.

    Tensors must be contiguous CPU tensors of the spec's dtypes: a wrong one raises
    `DistcacheError` instead of reaching the C code as a pointer to memory of another layout."""

    def __init__(self, name: str, function: ctypes._CFuncPtr):
        self.name = name
        self._args, self._flags = _SPECS[name]
        types = {"i": ctypes.c_int64, "f": ctypes.c_double}
        function.argtypes = [types.get(kind, ctypes.c_void_p) for kind in self._args] + [
            ctypes.c_int64 for _ in self._flags
        ]
        function.restype = None
        self._function = function

    def __getitem__(self, grid: object) -> NativeKernel:
        return self  # (one call covers every entry)

    def __call__(self, *args: object, **constexprs: object) -> None:
        if len(args) != len(self._args):
            raise DistcacheError(f"{self.name}: {len(args)} arguments, expected {len(self._args)}")
        values: list[int | float] = []
        for at, (value, kind) in enumerate(zip(args, self._args, strict=True)):
            if kind == "i":
                values.append(int(value))
            elif kind == "f":
                values.append(float(value))
            elif (kind is None or value.dtype is kind) and value.is_cpu and value.is_contiguous():
                values.append(value.data_ptr())
            else:
                raise self._refused(at, value, kind)
        values += [int(constexprs[flag]) for flag in self._flags]
        self._function(*values)

    def _refused(self, at: int, value: torch.Tensor, kind: torch.dtype | None) -> DistcacheError:
        if not value.is_cpu:
            return DistcacheError(f"{self.name}: argument {at} is on {value.device}, not the CPU")
        return DistcacheError(
            f"{self.name}: argument {at} is a {value.dtype} tensor (contiguous: "
            f"{value.is_contiguous()}), expected a contiguous {kind or 'tensor'}"
        )


@functools.cache
def load() -> dict[str, NativeKernel] | None:
    """The kernels by name (as `fused_kernels.build` names them), built on first use; None
    where they cannot be built (no C compiler: the reason is logged)."""
    try:
        library = ctypes.CDLL(str(_built()))
    except (OSError, DistcacheError, subprocess.SubprocessError) as err:
        _log.info("distcache: the fused passes' C kernels are not available (%s)", err)
        return None
    return {name: NativeKernel(name, getattr(library, f"dc_{name}")) for name in _SPECS}


def _built() -> Path:
    """The shared library of `fused_native.c`, compiled where it is not yet."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise DistcacheError("no C compiler found: set CC, or install cc or gcc")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), platform.machine().encode()]))
    name = f"fused_native-{key.hexdigest()[:16]}.so"
    for folder in _folders():
        library = folder / name
        if library.exists():
            return library
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkstemp(dir=folder, suffix=".so.partial")[1])
        except OSError:
            continue  # not writable: the next folder
        try:
            command = [*shlex.split(compiler), "-O3", "-std=c99", "-shared", "-fPIC"]
            command += ["-o", str(partial)]
            done = subprocess.run(
                [*command, str(_SOURCE)], capture_output=True, text=True, timeout=120
            )
            if done.returncode != 0:
                lines = (done.stderr or done.stdout).strip().splitlines()
                said = [line for line in lines if "error" in line] or lines
                raise DistcacheError(f"{compiler} failed: {said[0] if said else done.returncode}")
            os.replace(partial, library)  # atomic: ranks building at once each finish one
        finally:
            partial.unlink(missing_ok=True)
        return library
    raise DistcacheError("no writable folder for the compiled kernels")


def _folders() -> list[Path]:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return [Path(cache) / "distcache", Path(tempfile.gettempdir()) / "distcache"]
