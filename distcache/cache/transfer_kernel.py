"""The Triton kernel of `transfer.copy_rows`, imported only where Triton is installed.

This module has no `from __future__ import annotations`: Triton reads the `tl.constexpr`
annotation as an object.
"""

import os

import triton
import triton.language as tl


# Program `entry` copies row `src_rows[entry]` of `src` to row `dst_rows[entry]` of `dst` if
# `entry < count[0]`; the others read and write nothing.
def _copy_rows(
    src, src_rows, dst, dst_rows, count, width, src_stride, dst_stride, BLOCK: tl.constexpr
):
    entry = tl.program_id(0)
    if entry < tl.load(count):
        src_row = tl.load(src_rows + entry).to(tl.int64)
        dst_row = tl.load(dst_rows + entry).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        values = tl.load(src + src_row * src_stride + cols, mask=inside)
        tl.store(dst + dst_row * dst_stride + cols, values, mask=inside)


def build(*, interpret: bool):  # a triton.JITFunction
    """The kernel, compiled for the GPU, or (`interpret`) run by Triton's interpreter on CPU
    tensors."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return triton.jit(_copy_rows)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
