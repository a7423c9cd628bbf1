"""The Triton kernels of the scheduler's fused passes (`fused.py`), imported only where Triton is
installed.

This module has no `from __future__ import annotations`: Triton reads the `tl.constexpr`
annotation as an object.
"""

import os

import triton
import triton.language as tl


# `first[i]`: 1 where sorted position i starts a distinct row (its value differs from the one
# before it), else 0, as int32 (what the running count of rows is summed in).
def _first(ordered, first, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    row = tl.load(ordered + i, mask=inside, other=0)
    before = tl.load(ordered + i - 1, mask=inside & (i > 0), other=0)
    starts = (i == 0) | (row != before)
    tl.store(first + i, starts.to(tl.int32), mask=inside)


# A batch entering the window, from its sorted ids (`ordered`, int32, with `order` the sort's
# permutation) and `count[i]`, the distinct rows among ordered[:i + 1]. Sorted position i that
# starts a row owns packed position r = count[i] - 1 and does that row's work: its packed row,
# whether it is real, its previous occurrence linked to this batch, its latest occurrence, and
# (where this batch is its first use in the window) its resident slot's next use. Position i
# also writes its own position and, past the distinct rows, the padding. Every address a
# program writes is its own (rows are distinct, positions are this batch's, `order` is a
# permutation), so the programs run in any order. The ids that are not the sentinel row (the
# largest id: they sort first) are counted by the position that ends them, which adds i + 1 to
# `total` (int64). (Only Triton's core ops: the interpreter of the tests runs no `tl.sum`.)
def _enter(
    ordered,
    order,
    count,
    at,
    latest,
    next_use,
    slot_of,
    slot_next_use,
    total,
    rows_out,
    inv_out,
    valid_out,
    pos_out,
    n,
    sentinel_row,
    no_use,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    seq = tl.load(at)
    base = tl.load(at + 1)
    row = tl.load(ordered + i, mask=inside, other=0)
    before = tl.load(ordered + i - 1, mask=inside & (i > 0), other=0)
    after = tl.load(ordered + i + 1, mask=i + 1 < n, other=sentinel_row)
    first = inside & ((i == 0) | (row != before))
    r = tl.load(count + i, mask=inside, other=1) - 1
    distinct = tl.load(count + n - 1)
    tl.store(inv_out + tl.load(order + i, mask=inside, other=0), r, mask=inside)
    real = first & (row != sentinel_row)
    pos = base + r
    at_row = row.to(tl.int64)  # (tables of up to 2**31 rows)
    prev = tl.load(latest + at_row, mask=real, other=-1)
    fresh = real & (prev < 0)
    tl.store(next_use + prev, seq, mask=real & (prev >= 0))
    tl.store(latest + at_row, pos, mask=real)
    slot = tl.load(slot_of + at_row, mask=fresh, other=-1)
    tl.store(slot_next_use + slot, seq, mask=fresh & (slot >= 0))
    tl.store(rows_out + r, at_row, mask=first)
    tl.store(valid_out + r, real.to(tl.uint8), mask=first)
    pad = inside & (i >= distinct)
    zero = (i * 0).to(tl.int64)
    tl.store(rows_out + i, zero + sentinel_row, mask=pad)
    tl.store(valid_out + i, zero.to(tl.uint8), mask=pad)
    tl.store(pos_out + i, base + i, mask=inside)
    tl.store(next_use + base + i, zero.to(tl.int32) + no_use, mask=inside)
    last = inside & (row != sentinel_row) & (after == sentinel_row)
    tl.atomic_add(total + zero, zero + i + 1, mask=last)


def build(*, interpret: bool) -> dict:  # name -> triton.JITFunction
    """The kernels, compiled for the GPU, or (`interpret`) run by Triton's interpreter on CPU
    tensors."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return {"first": triton.jit(_first), "enter": triton.jit(_enter)}
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
