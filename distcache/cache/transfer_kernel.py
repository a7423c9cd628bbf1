"""The Triton kernel of `transfer.copy_rows`, imported only where Triton is installed.

This module has no `from __future__ import annotations`: Triton reads the `tl.constexpr`
annotation as an object.
"""

import os

import triton
import triton.language as tl


# A few programs (`transfer.STAGING_PROGRAMS`) stride over the entries below `count[0]`, `ROWS`
# entries at a time: entry e copies row `src_rows[e]` of `src` to row `dst_rows[e]` of `dst`.
# The entries from `count[0]` on read and write nothing. However many rows a plan moves, the
# copy holds at most that many thread blocks, leaving the rest of the GPU to training.
def _copy_rows(
    src,
    src_rows,
    dst,
    dst_rows,
    count,
    width,
    src_stride,
    dst_stride,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    n = tl.load(count)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    first = program * ROWS
    while first < n:  # (a `range` with these bounds does not run in Triton's interpreter)
        entries = first + tl.arange(0, ROWS)
        live = entries < n
        src_row = tl.load(src_rows + entries, mask=live, other=0).to(tl.int64)
        dst_row = tl.load(dst_rows + entries, mask=live, other=0).to(tl.int64)
        mask = live[:, None] & inside[None, :]
        values = tl.load(src + src_row[:, None] * src_stride + cols[None, :], mask=mask)
        tl.store(dst + dst_row[:, None] * dst_stride + cols[None, :], values, mask=mask)
        first += programs * ROWS


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
