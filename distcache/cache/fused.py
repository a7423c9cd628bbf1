"""The scheduler's per-batch passes as a few fused kernels (`CacheConfig.fused`).

On a GPU the scheduler's work for a batch is about 150 small kernels (a graph replays them with
one launch, but each still costs the device a few microseconds and a pass over its operands).
A fused pass does in one kernel what a run of them does, reading each operand once. Each one
here computes exactly what the torch ops it replaces compute (the same values, the same state
left behind: `tests/unit/cache/test_fused.py` runs both on the same traces), so the torch ops
remain the reference, and the path every device without Triton runs.

Fused so far (counted in torch ops and kernels that launch work, a steady-state batch of
3,000 ids of a 200,000-row table in a full 20,000-slot cache, 6,000 slots swept:
`Scheduler.enqueue` 37 -> 5, `stage_next` 94 -> 26; and the routing of 26 sum-pooled features
16 -> 2. `benchmarks/engine_throughput.py` section 4 counts a whole step of its 5 % cache,
forward and backward, without graphs: 165 -> 51 launches, the same 6,447 evictions):
- `route`: a batch routed into a cache whose one group serves every feature
  (`Router.route_device`): each id's bag (a binary search of the offsets), its
  feature, its engine row, checked against its table's rows (the invalid ones counted);
- `enter`: a batch entering the window (`Window.enter_device` and the scheduler's next uses of
  resident rows): after the sort and the running count of distinct rows, one kernel packs the
  rows, inverts the sort, links each row's previous occurrence, records its latest one, resets
  the batch's positions, gives the resident rows it is the first to use their next use, and
  counts the ids;
- `look_up`: a staging batch's rows leave the window and are looked up, pinned or flagged as
  misses (`Scheduler._look_up`);
- `place`: the victims' rows evicted (flagged for write-back), then each row's slot taken and
  recorded in both maps, pinned, its next use kept, the rows to load listed
  (`Scheduler._place`), and the look-ahead policy's use counts kept (its `on_stage`): two
  kernels, the first reads the victims' rows before the second replaces them;
- `candidates`: once the cache is full, the look-ahead policy's candidate slots (a sweep, or
  every slot) scored and counted into the histogram that selects victims (`Victims.choose`);
- `select_counted`: the victims selected from that histogram: the boundary class found by one
  program (a binary search of the histogram's running count), the boundary's candidates
  flagged, the selected ones flagged (then compacted by `nonzero_static`).
The reactive policies' candidates stay torch ops, and so do the look-ahead policy's while the
cache may have free slots, but on CPU (`candidates_free`, C only).

On CUDA the kernels are Triton's (`fused_kernels`), compiled. On CPU they are C
(`fused_native`, the default there: Triton's kernels one for one, but for the batch's sort and
the victims' selection, which the CPU does its own way, and passes only the CPU fuses, each
named "C only" here); Triton's interpreter runs Triton's where no C compiler is found (slow:
for tests, which compare both with the torch ops). Their launches are
not torch ops, so the CPU emulation of graphs (`graphs.CPUGraph`) cannot record them: on CPU
they run without graphs. A CUDA graph captures them like any kernel.
"""

from __future__ import annotations

import functools

import torch

from distcache.cache import fused_native
from distcache.cache.policies import LookaheadPolicy
from distcache.cache.residency import NO_USE, Residency
from distcache.cache.window import Window
from distcache.errors import DistcacheConfigError

BLOCK = 1024  # ids per program


def _grid(n: int) -> tuple[int]:
    """The programs that cover `n` entries, `BLOCK` each (at least one)."""
    return (max(1, -(-n // BLOCK)),)


CPU_KERNELS = "native"
"""Which kernels run the fused passes on CPU: "native" (`fused_native`'s C, where a C compiler
built them; else Triton's interpreter) or "triton" (Triton's interpreter: tests set it)."""


@functools.cache
def _kernels(*, interpret: bool) -> dict | None:
    try:
        from distcache.cache import fused_kernels
    except ImportError:
        return None
    return fused_kernels.build(interpret=interpret)


def kernels(device: torch.device, *, graphs: bool = False) -> dict:
    """The fused kernels for `device`: Triton's compiled for CUDA; on CPU the C kernels of
    `fused_native` (`CPU_KERNELS`), else Triton's interpreted (slow: for tests).

    Raises:
        DistcacheConfigError: neither is available (no C compiler, no Triton), or graphs are
            asked on CPU (their emulation records torch ops only).
    """
    cuda = device.type == "cuda"
    if not cuda and graphs:
        raise DistcacheConfigError(
            "CacheConfig.fused=True with cuda_graphs=True on CPU: the CPU emulation of graphs "
            "records torch ops, not the fused kernels; use cuda_graphs=False on CPU"
        )
    found = None if cuda or CPU_KERNELS != "native" else fused_native.load()
    found = found or _kernels(interpret=not cuda)
    if found is None:
        needs = "Triton (pip install triton)" if cuda else "a C compiler (cc, gcc) or Triton"
        raise DistcacheConfigError(
            f"CacheConfig.fused=True needs {needs}, which is not installed; use fused=False"
        )
    return found


def enter(
    found: dict,
    window: Window,
    residency: Residency,
    total: torch.Tensor,
    ids: torch.Tensor,
    at: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """`Window.enter_device(ids, at)`'s `rows, inv, valid, positions` and `distinct`, with the
    scheduler's entry work done as well: the resident rows the batch is the first in the
    window to use get its seq as their slot's next use, and its ids that are not the sentinel
    row are added to `total` (a 0-dim int64 view)."""
    n, device = ids.numel(), ids.device
    if n == 0:
        empty = ids.new_empty(0)
        none = torch.zeros(1, dtype=torch.int32, device=device)
        return empty, empty.int(), empty.bool(), empty.int(), none
    ids, grid = ids.to(torch.int32), _grid(n)
    if "sort" in found:  # the C kernels' own: a radix sort of the batch, and its count
        ordered, order = torch.empty_like(ids), torch.empty(n, dtype=torch.int64, device=device)
        count, scratch = torch.empty_like(ids), (torch.empty_like(ids), torch.empty_like(order))
        found["sort"][(1,)](ids, ordered, order, count, *scratch, n, window.sentinel_row)
    else:
        ordered, order = window.sort(ids)
        first = torch.empty(n, dtype=torch.int32, device=device)
        found["first"][grid](ordered, first, n, BLOCK=BLOCK)
        count = first.cumsum(0, dtype=torch.int32)  # distinct rows among ordered[: i + 1]
    rows = torch.empty(n, dtype=torch.int64, device=device)
    inv = torch.empty(n, dtype=torch.int32, device=device)
    valid = torch.empty(n, dtype=torch.bool, device=device)
    positions = torch.empty(n, dtype=torch.int32, device=device)
    found["enter"][grid](
        ordered, order, count, at, window.latest, window.next_use, residency.slot_of,
        residency.next_use, total, rows, inv, valid.view(torch.uint8), positions, n,
        window.sentinel_row, NO_USE, BLOCK=BLOCK,
    )  # fmt: skip
    return rows, inv, valid, positions, count[-1:]


def look_up(
    found: dict, window: Window, residency: Residency, rows: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """A staging batch's rows leave the window and are looked up (`Scheduler._look_up`):
    each row's next use `[m]` int32, its miss flag `[m]` int32, its slot or the sentinel slot
    `[m]` int64 (pinned), the running count of misses `[m]` int32 and the misses (0-dim
    int64). `m` must be at least 1."""
    m, device = rows.numel(), rows.device
    next_use = torch.empty(m, dtype=torch.int32, device=device)
    miss = torch.empty(m, dtype=torch.int32, device=device)
    hit = torch.empty(m, dtype=torch.int64, device=device)
    found["look_up"][_grid(m)](
        rows, positions, window.latest, window.next_use, residency.slot_of, residency.pin,
        next_use, miss, hit, m, residency.sentinel_slot, BLOCK=BLOCK,
    )  # fmt: skip
    count = miss.cumsum(0, dtype=torch.int32)
    return next_use, miss, hit, count, count[-1].long()


def place(
    found: dict,
    residency: Residency,
    rows: torch.Tensor,
    looked_up: tuple[torch.Tensor, ...],
    victims: torch.Tensor,
    taken: torch.Tensor,
    size: int,
    uses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The plan's residency updates (`Scheduler._place`) from `look_up`'s results: each row's
    slot `[m]` int64, which rows got a victim `[m]`, the victims' old rows `[size + 1]`, which
    were evicted and which written back (bool), and the rows to load `[size]` (then the
    sentinel row). `uses`: the look-ahead policy's (`LookaheadPolicy.on_stage` done too)."""
    next_use, miss, hit, count, _ = looked_up
    m, v, device = rows.numel(), victims.numel(), rows.device
    old = torch.empty(v, dtype=torch.int64, device=device)
    evicted = torch.empty(v, dtype=torch.bool, device=device)
    writeback = torch.empty(v, dtype=torch.bool, device=device)
    res = residency
    found["evict"][_grid(v)](
        victims, res.row_of, res.slot_of, res.dirty.view(torch.uint8), old,
        evicted.view(torch.uint8), writeback.view(torch.uint8), v, res.capacity, BLOCK=BLOCK,
    )  # fmt: skip
    slot = torch.empty(m, dtype=torch.int64, device=device)
    got = torch.empty(m, dtype=torch.bool, device=device)
    loads = torch.full((size + 1,), res.sentinel_row, dtype=torch.int64, device=device)
    found["place"][_grid(m)](
        rows, miss, count, hit, victims, taken, next_use, res.slot_of, res.row_of, res.pin,
        res.next_use, slot, got.view(torch.uint8), loads, slot if uses is None else uses, m,
        size, res.sentinel_slot, USES=uses is not None, BLOCK=BLOCK,
    )  # fmt: skip
    return slot, got, old, evicted, writeback, loads[:size]


def candidates(
    found: dict,
    residency: Residency,
    policy: LookaheadPolicy,
    hand: torch.Tensor,
    seq: torch.Tensor,
    scan: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The look-ahead policy's candidates once the cache is full (`Victims.choose` with
    `free=False`): `scan` slots swept from `hand` (moved past them), or every slot where
    `scan` covers the cache; their slots `[m + 1]` (then the sentinel slot), keys `[m]`
    (int32, -1 where pinned) and the keys' histogram (`select.select_counted`)."""
    cap, device = residency.capacity, hand.device
    sweep = scan < cap
    m = scan if sweep else cap
    slots = torch.empty(m + 1, dtype=torch.int64, device=device)
    keys = torch.empty(m, dtype=torch.int32, device=device)
    hist = torch.zeros(policy.classes + 1, dtype=torch.int32, device=device)
    hand_out = torch.empty(1, dtype=torch.int64, device=device) if sweep else slots
    found["candidates"][_grid(m + 1)](
        hand, seq, residency.pin, residency.next_use, policy.uses, slots, keys, hist,
        hand_out, m, cap, residency.sentinel_slot, policy.far, policy.use_bits,
        (1 << policy.use_bits) - 1, SWEEP=sweep, BLOCK=BLOCK,
    )  # fmt: skip
    if sweep:
        hand.copy_(hand_out[0])
    return slots, keys, hist


def candidates_free(
    found: dict,
    residency: Residency,
    policy: LookaheadPolicy,
    hand: torch.Tensor,
    fill: torch.Tensor,
    seq: torch.Tensor,
    size: int,
    scan: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`candidates` while the cache may still have free slots (`Victims.choose` with `free`),
    in one C kernel (C only: `"candidates_free" in found`): the next `size` free slots from
    `fill` first, then `scan` slots swept from `hand` (moved past them), or every slot where
    `scan` covers the cache, free ones keyed first; their slots `[m + 1]` (then the sentinel
    slot), keys `[m]` (-1 where not offered) and the keys' histogram."""
    cap, device = residency.capacity, hand.device
    sweep = scan < cap
    m = size + scan if sweep else cap
    slots = torch.empty(m + 1, dtype=torch.int64, device=device)
    keys = torch.empty(m, dtype=torch.int32, device=device)
    hist = torch.zeros(policy.classes + 1, dtype=torch.int32, device=device)
    found["candidates_free"][(1,)](
        hand, fill, seq, residency.pin, residency.next_use, policy.uses, slots, keys, hist,
        size, scan, cap, residency.sentinel_slot, residency.trash_slot, policy.far,
        policy.use_bits, (1 << policy.use_bits) - 1, sweep,
    )  # fmt: skip
    return slots, keys, hist


def select_counted(
    found: dict,
    keys: torch.Tensor,
    hist: torch.Tensor,
    num_classes: int,
    want: torch.Tensor,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select.select_counted` (the same results) in three kernels beside its two running
    counts and the compaction: the boundary class found by one program, the boundary's keys
    flagged, then the selected ones."""
    m, device = keys.numel(), keys.device
    if "select" in found:  # the C kernels': one pass, no running counts
        picked = torch.empty(size, dtype=torch.int64, device=device)
        line = torch.empty(4, dtype=torch.int64, device=device)
        found["select"][(1,)](keys, hist, want, picked, line, m, num_classes, size)
        return picked, line[2], line[3]
    below = hist[1:].cumsum(0, dtype=hist.dtype)
    line = torch.empty(4, dtype=torch.int64, device=device)  # boundary, need, taken, candidates
    found["boundary"][(1,)](below, want, line, num_classes, STEPS=num_classes.bit_length() + 1)
    grid = _grid(m)
    tie = torch.empty(m, dtype=torch.int32, device=device)
    found["ties"][grid](keys, line, tie, m, BLOCK=BLOCK)
    take = torch.empty(m, dtype=torch.bool, device=device)
    ties = tie.cumsum(0, dtype=torch.int32)
    found["take"][grid](keys, line, ties, take.view(torch.uint8), m, BLOCK=BLOCK)
    picked = torch.nonzero_static(take, size=size, fill_value=m).squeeze(1)
    return picked, line[2], line[3]


def distinct(
    found: dict, window: Window, total: torch.Tensor, ids: torch.Tensor, at: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`Window.distinct_device(ids, at, ids != sentinel row)` for a cache of every row, with
    its ids that are not the sentinel row added to `total` (a 0-dim int64 view), in one C
    kernel (CPU only: `"distinct" in found`)."""
    n, device = ids.numel(), ids.device
    rows = torch.empty(n, dtype=torch.int64, device=device)
    rep = torch.empty(n, dtype=torch.int32, device=device)
    valid = torch.empty(n, dtype=torch.bool, device=device)
    positions = torch.empty(n, dtype=torch.int32, device=device)
    found["distinct"][(1,)](
        ids, at, window.latest, total, rows, rep, valid.view(torch.uint8), positions, n,
        window.sentinel_row,
    )  # fmt: skip
    return rows, rep, valid, positions


def sgd(
    found: dict,
    weights: torch.Tensor,
    bag_grad: torch.Tensor,
    bag_of_id: torch.Tensor | None,
    id_weights: torch.Tensor | None,
    id_slots: torch.Tensor,
    lr: float,
    batch_major: tuple[int, int] | None = None,
) -> None:
    """`CacheEngine.apply_gradients`'s SGD step on fp32 rows in one C kernel (CPU only: `"sgd"
    in found`), the same float32 operations in the same order: each id's row (`id_slots`)
    plus its bag's gradient (`bag_of_id`; None: its own) times -lr, times its weight.
    `batch_major` (batch, features): the gradient is `[batch, features * dim]`, the bags'
    transpose (`pool`'s layout), read as it is."""
    n, dim, grad = id_slots.numel(), weights.shape[1], bag_grad.contiguous()
    batch, features = batch_major or (0, 0)
    found["sgd"][(1,)](
        weights, grad, id_slots if bag_of_id is None else bag_of_id,
        grad if id_weights is None else id_weights.contiguous(), id_slots, n, dim, lr, batch,
        features, POOLED=bag_of_id is not None, WEIGHTED=id_weights is not None,
        BATCH_MAJOR=batch_major is not None,
    )  # fmt: skip


def pool(
    found: dict,
    weights: torch.Tensor,
    id_slots: torch.Tensor,
    offsets: torch.Tensor,
    divisor: torch.Tensor | None,
    batch: int,
    features: int,
) -> torch.Tensor:
    """`[batch, features * dim]` float32: the sums of a batch's rows per bag (`embedding_bag`,
    mode 'sum', no per-id weights; divided by `divisor` `[bags]` where given) in the layout of
    the module's output, feature f's bag b at row b, columns f * dim on (C only: `"pool" in
    found`): `embedding_bag` and the transpose in one pass, the same float32 operations. Rows
    fp32, `offsets` `[features * batch + 1]` covering every id."""
    dim = weights.shape[1]
    out = torch.empty(batch, features * dim, dtype=torch.float32, device=weights.device)
    found["pool"][(1,)](
        weights, id_slots, offsets, out if divisor is None else divisor, out, batch, features,
        dim, divisor is not None,
    )  # fmt: skip
    return out


def check(
    found: dict, values: torch.Tensor, ids_per_feature: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's int64 ids in feature-major order with each invalid one (outside [0, rows) of
    its feature's table) replaced by 0, and how many were (`[1]` int64), in one C kernel (CPU
    only: `"check" in found`): `ids.find_invalid_per_feature` and the replacement."""
    n = values.numel()
    checked = torch.empty_like(values)
    count = torch.zeros(1, dtype=torch.int64, device=values.device)
    found["check"][(1,)](values, ids_per_feature, rows, checked, count, n, rows.numel())
    return checked, count


def check_batch(
    found: dict, lengths: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, stride: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's lengths and ids checked in one C call (C only: `"check_batch" in found`), for
    `rows.numel()` features of `stride` bags each (`lengths` int32 or int64, feature-major) and
    int64 ids: the ids of each feature `[F]` int64, the count of ids outside their feature's
    rows `[1]` int64 (`check`'s; none is replaced) and `[2]` int64: the lengths' total and 1 if
    one is negative. The ids are counted only where the lengths add up to them and none is
    negative (else the count is 0, and not to be read)."""
    keys = rows.numel()
    out = torch.zeros(keys + 3, dtype=torch.int64, device=values.device)  # per key, summary
    found["check_batch"][(1,)](
        lengths, values, rows, out, out[keys:], lengths.dtype == torch.int64, values.numel(),
        keys, stride,
    )  # fmt: skip
    return out[:keys], out[keys + 2 :], out[keys : keys + 2]


def move(
    found: dict,
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """Rows `src[src_rows[k]]` copied to `dst[dst_rows[k]]` (`[count]` int64 each), in one C
    kernel (CPU only: `"move" in found`): the stager's gathers and scatters of rows between
    the host store and the cache. Both tables row-major, rows of the same bytes."""
    width = src.shape[1] * src.element_size()
    if dst.shape[1] * dst.element_size() != width or src.dtype != dst.dtype:
        raise DistcacheConfigError(
            f"rows of {src.dtype} x {src.shape[1]} cannot move into rows of {dst.dtype} x "
            f"{dst.shape[1]}"
        )
    if width:
        found["move"][(1,)](src, src_rows, dst, dst_rows, src_rows.numel(), width)


def finish(
    found: dict,
    valid: torch.Tensor,
    slot: torch.Tensor,
    inv: torch.Tensor,
    placed: tuple[torch.Tensor, ...],
    victims: torch.Tensor,
    chosen: tuple[torch.Tensor, ...],
    fill: torch.Tensor,
    capacity: int,
    totals: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The last of `Scheduler._stage_device`'s work in one C kernel (CPU only: `"finish" in
    found`): each id's slot, the dirty victims' rows and slots packed (`[size]` each, padded
    with the sentinel victim's) and the plan's counts (`[NUM_COUNTS]` int64, added to
    `totals`). `placed`: `place`'s old rows, evictions and write-backs; `chosen`: the misses,
    the victims taken and the candidates (0-dim int64); `fill`: the first free slot."""
    old, evicted, writeback = placed
    want, taken, candidates = chosen
    size, device = victims.numel() - 1, slot.device
    id_slots = torch.empty(inv.numel(), dtype=torch.int64, device=device)
    rows, slots = (torch.empty(size, dtype=torch.int64, device=device) for _ in range(2))
    counts = torch.empty(totals.numel(), dtype=torch.int64, device=device)
    found["finish"][(1,)](
        valid.view(torch.uint8), slot, inv, writeback.view(torch.uint8),
        evicted.view(torch.uint8), old, victims, want, taken, candidates, fill, id_slots, rows,
        slots, counts, totals, valid.numel(), inv.numel(), size, capacity,
    )  # fmt: skip
    return id_slots, rows, slots, counts


def finish_whole(
    found: dict, valid: torch.Tensor, rows: torch.Tensor, inv: torch.Tensor, totals: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`finish` for a cache of every row (`Scheduler._stage_whole`), in one C kernel (CPU
    only: `"finish_whole" in found`): each id's slot (its row) and the plan's counts, its
    unique rows alone (added to `totals`)."""
    device = rows.device
    id_slots = torch.empty(inv.numel(), dtype=torch.int64, device=device)
    counts = torch.empty(totals.numel(), dtype=torch.int64, device=device)
    found["finish_whole"][(1,)](
        valid.view(torch.uint8), rows, inv, id_slots, counts, totals, valid.numel(), inv.numel(),
    )  # fmt: skip
    return id_slots, counts


def route(
    found: dict,
    values: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    row_offset: torch.Tensor,
    sentinel_row: int,
    num_features: int,
    *,
    padded_ids: bool,
    check_ids: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A batch's routing into a cache whose one group serves every feature
    (`Router.route_device`, in one kernel): each id's engine row `[n]` (the
    sentinel row for invalid ids and padding), its bag `[n]`, and with `check_ids` how many ids
    are out of range (`[1]` int64, `ids.find_invalid`'s count)."""
    n, num_bags, device = values.numel(), offsets.numel() - 1, values.device
    ids = torch.empty(n, dtype=torch.int64, device=device)
    bag_of_id = torch.empty(n, dtype=torch.int64, device=device)
    check = torch.zeros(1, dtype=torch.int64, device=device)
    found["route"][_grid(n)](
        values, offsets, rows, row_offset, ids, bag_of_id, check, n, num_bags,
        num_bags // num_features, num_features, sentinel_row, CHECK=check_ids,
        PADDED=padded_ids, STEPS=num_bags.bit_length() + 1, BLOCK=BLOCK,
    )  # fmt: skip
    return ids, bag_of_id, check if check_ids else None
