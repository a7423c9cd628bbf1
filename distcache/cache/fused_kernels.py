"""The Triton kernels of the scheduler's fused passes (`fused.py`), imported only where Triton is
installed.

This module has no `from __future__ import annotations`: Triton reads the `tl.constexpr`
annotation as an object.
"""

import inspect
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


# A staging batch's rows (`rows`, packed, at `positions` in the window's ring), row j each: it
# leaves the window (its next use read from the ring; its latest occurrence forgotten where it
# is this one) and is looked up in the cache: a resident row's slot is pinned (an atomic add),
# a missing row is flagged (int32, for its running count). (The torch ops also pin the
# sentinel slot for each miss and each padding row, the sentinel row's: thousands of atomic
# adds to one address a batch on a GPU, for a count nothing reads. The kernels leave it.)
def _look_up(
    rows,
    positions,
    latest,
    ring,
    slot_of,
    pin,
    next_use_out,
    miss_out,
    hit_out,
    n,
    sentinel_slot,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    row = tl.load(rows + i, mask=inside, other=0)
    pos = tl.load(positions + i, mask=inside, other=0)
    tl.store(next_use_out + i, tl.load(ring + pos, mask=inside, other=0), mask=inside)
    last = inside & (tl.load(latest + row, mask=inside, other=-1) == pos)
    tl.store(latest + row, pos * 0 - 1, mask=last)
    slot = tl.load(slot_of + row, mask=inside, other=0).to(tl.int64)
    miss = slot < 0
    hit = tl.where(miss, slot * 0 + sentinel_slot, slot)
    tl.store(miss_out + i, miss.to(tl.int32), mask=inside)
    tl.store(hit_out + i, hit, mask=inside)
    tl.atomic_add(pin + hit, (pos * 0 + 1).to(tl.int32), mask=inside & (hit != sentinel_slot))


# The victims' side of a plan, entry v of `victims` (the chosen slots, then the sentinel slot):
# the row a real victim holds is evicted (no longer resident), written back if its slot is
# dirty, and the slot is clean from now on. Runs before `_place`, which refills the slots.
def _evict(
    victims,
    row_of,
    slot_of,
    dirty,
    old_out,
    evicted_out,
    writeback_out,
    n,
    capacity,
    BLOCK: tl.constexpr,
):
    v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = v < n
    victim = tl.load(victims + v, mask=inside, other=0)
    old = tl.load(row_of + victim, mask=inside, other=-1)
    evicted = inside & (victim < capacity) & (old >= 0)
    writeback = evicted & (tl.load(dirty + victim, mask=inside, other=0) != 0)
    tl.store(slot_of + old, (old * 0 - 1).to(tl.int32), mask=evicted)
    tl.store(dirty + victim, (victim * 0).to(tl.uint8), mask=inside)
    tl.store(old_out + v, old, mask=inside)
    tl.store(evicted_out + v, evicted.to(tl.uint8), mask=inside)
    tl.store(writeback_out + v, writeback.to(tl.uint8), mask=inside)


# Row j of a staging batch takes its slot: the k-th miss (k = count[j] - 1) the k-th victim,
# if there is one (k < taken), and becomes resident there (both maps), its slot pinned, its
# next use recorded, and it is listed at k among the rows to load. A hit keeps its slot. (A
# miss past the victims, an overflow that the engine raises at lookup, reads the sentinel
# slot.) With `USES`, the look-ahead policy's `on_stage` too: a loaded row's slot has been used
# once, the others once more. (The sentinel slot's pin and use counts, which the torch ops
# count and nothing reads, are left: see `_look_up`.)
def _place(
    rows,
    miss,
    count,
    hit,
    victims,
    taken,
    next_use,
    slot_of,
    row_of,
    pin,
    slot_next_use,
    slot_out,
    got_out,
    loads_out,
    uses,
    n,
    size,
    sentinel_slot,
    USES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    k = tl.load(count + i, mask=inside, other=1) - 1
    got = inside & (tl.load(miss + i, mask=inside, other=0) != 0) & (k < tl.load(taken))
    victim = tl.load(victims + tl.minimum(tl.maximum(k, 0), size), mask=inside, other=0)
    slot = tl.where(got, victim, tl.load(hit + i, mask=inside, other=0))
    row = tl.load(rows + i, mask=inside, other=0)
    tl.store(slot_of + row, slot.to(tl.int32), mask=got)
    tl.store(row_of + slot, row, mask=got)
    tl.atomic_add(pin + slot, (k * 0 + 1).to(tl.int32), mask=got)
    use = tl.load(next_use + i, mask=inside, other=0)
    tl.store(slot_next_use + slot, use, mask=inside & (slot != sentinel_slot))
    tl.store(loads_out + k, row, mask=got)
    tl.store(slot_out + i, slot, mask=inside)
    tl.store(got_out + i, got.to(tl.uint8), mask=inside)
    if USES:
        once = (k * 0 + 1).to(tl.int32)
        tl.store(uses + slot, once, mask=got)
        tl.atomic_add(uses + slot, once, mask=inside & ~got & (slot != sentinel_slot))


# The look-ahead policy's candidates for a staging batch once the cache is full
# (`Victims.choose`): candidate c is slot hand + c (wrapping; with `SWEEP` off, slot c: every
# slot), scored by `LookaheadPolicy.keys` (the distance class of its row's next use, then its
# rarity), -1 where the slot is pinned, and counted into the histogram of `select_counted`
# (atomically: bin k + 1 for key k). Entry m is the sentinel slot (what padding picks) and,
# swept, the next sweep's start is written to `hand_out`.
def _candidates(
    hand,
    seq_at,
    pin,
    next_use,
    uses,
    slots_out,
    keys_out,
    hist,
    hand_out,
    m,
    capacity,
    sentinel_slot,
    far,
    use_bits,
    top,
    SWEEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = c < m
    slot = c.to(tl.int64)
    if SWEEP:
        slot = tl.load(hand) + slot
        slot = tl.where(slot < capacity, slot, slot - capacity)
    seq = tl.load(seq_at)
    pinned = tl.load(pin + slot, mask=inside, other=0) != 0
    distance = tl.load(next_use + slot, mask=inside, other=0) - seq
    distance = tl.minimum(tl.maximum(distance, 0), far)
    rarity = top - tl.minimum(tl.load(uses + slot, mask=inside, other=0), top)
    key = tl.where(pinned, distance * 0 - 1, (distance << use_bits) | rarity)
    tl.store(keys_out + c, key, mask=inside)
    tl.store(slots_out + c, slot, mask=inside)
    tl.atomic_add(hist + key + 1, key * 0 + 1, mask=inside)
    end = c == m
    tl.store(slots_out + c, slot * 0 + sentinel_slot, mask=end)
    if SWEEP:
        tl.store(hand_out + c * 0, slot, mask=end)


# Where `select_counted` draws the line, in one program: `below[c]` the candidates of class at
# most c (the histogram's running count), `want` the victims wanted (int64). The boundary class
# is the first c whose count exceeds the candidates that may stay (a binary search of `below`,
# as `searchsorted(right=True)`, at most classes - 1); `need` is how many of its keys are taken.
# `out`: boundary, need, taken (min(want, candidates)), candidates (int64).
def _boundary(below, want, out, classes, STEPS: tl.constexpr):
    candidates = tl.load(below + classes - 1).to(tl.int64)
    wanted = tl.load(want)
    spare = (candidates - wanted).to(tl.int32)
    lo = classes * 0
    hi = classes + lo
    for _ in range(STEPS):
        open_ = lo < hi
        mid = (lo + hi) // 2
        right = open_ & (tl.load(below + mid, mask=open_, other=0) <= spare)
        hi = tl.where(open_ & ~right, mid, hi)
        lo = tl.where(right, mid + 1, lo)
    boundary = tl.minimum(lo, classes - 1)
    need = wanted - (candidates - tl.load(below + boundary).to(tl.int64))
    tl.store(out, boundary.to(tl.int64))
    tl.store(out + 1, need)
    tl.store(out + 2, tl.minimum(wanted, candidates))
    tl.store(out + 3, candidates)


# `tie[c]`: 1 where candidate c's key is the boundary class (int32, for its running count).
def _ties(keys, line, tie, m, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = c < m
    key = tl.load(keys + c, mask=inside, other=-1)
    tl.store(tie + c, (key == tl.load(line).to(tl.int32)).to(tl.int32), mask=inside)


# `take[c]`: candidate c is selected: its key is above the boundary, or it is among the first
# `need` of the boundary's (`ties`: their running count).
def _take(keys, line, ties, take, m, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = c < m
    key = tl.load(keys + c, mask=inside, other=-1)
    boundary = tl.load(line).to(tl.int32)
    need = tl.load(line + 1)
    tied = (key == boundary) & (tl.load(ties + c, mask=inside, other=0).to(tl.int64) <= need)
    tl.store(take + c, ((key > boundary) | tied).to(tl.uint8), mask=inside)


# A batch's routing into a cache whose one group serves every feature: id i's bag (the offsets
# of the bags' ends at most i: a binary search, as `searchsorted(right=True)`; `num_bags` for
# padding past the last bag), its feature (bags are feature-major), its engine row (the
# feature's first row added), or the sentinel row for an invalid id (`CHECK`: out of its
# table's range, counted atomically into `check`) and for padding (`PADDED`).
def _route(
    values,
    offsets,
    rows,
    row_offset,
    ids_out,
    bag_out,
    check,
    n,
    num_bags,
    batch_size,
    num_features,
    sentinel_row,
    CHECK: tl.constexpr,
    PADDED: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    lo = i * 0
    hi = lo + num_bags
    for _ in range(STEPS):
        open_ = inside & (lo < hi)
        mid = (lo + hi) // 2
        right = open_ & (tl.load(offsets + 1 + mid, mask=open_, other=0) <= i)
        hi = tl.where(open_ & ~right, mid, hi)
        lo = tl.where(right, mid + 1, lo)
    feature = tl.minimum(lo // batch_size, num_features - 1)
    value = tl.load(values + i, mask=inside, other=0)
    bad = inside & (lo < 0)  # (none)
    if PADDED:
        bad = inside & (lo >= num_bags)
    if CHECK:
        invalid = inside & ((value < 0) | (value >= tl.load(rows + feature, mask=inside, other=0)))
        one = value * 0 + 1
        tl.atomic_add(check + lo * 0, one, mask=invalid)
        bad = bad | invalid
    row = value + tl.load(row_offset + feature, mask=inside, other=0)
    tl.store(ids_out + i, tl.where(bad, value * 0 + sentinel_row, row), mask=inside)
    tl.store(bag_out + i, lo.to(tl.int64), mask=inside)


def _jit(fn):  # a triton.JITFunction
    """`fn` compiled once per constexpr and dtype, whatever its other arguments' values: no
    specialization on an int's value (1, a multiple of 16) or a pointer's alignment. A CUDA
    graph captures a pass with its inputs unpacked from one buffer (`graphs.GraphCache`: views
    at 8-byte offsets) after running it on fresh tensors; a kernel specialized on alignment
    would compile again inside the capture."""
    params = inspect.signature(fn).parameters.values()
    plain = [p.name for p in params if p.annotation is not tl.constexpr]
    return triton.jit(fn, do_not_specialize=plain, do_not_specialize_on_alignment=plain)


def build(*, interpret: bool) -> dict:  # name -> triton.JITFunction
    """The kernels, compiled for the GPU, or (`interpret`) run by Triton's interpreter on CPU
    tensors."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        kernels = {"first": _first, "enter": _enter, "look_up": _look_up}
        kernels.update(evict=_evict, place=_place, candidates=_candidates)
        kernels.update(boundary=_boundary, ties=_ties, take=_take, route=_route)
        return {name: _jit(fn) for name, fn in kernels.items()}
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
