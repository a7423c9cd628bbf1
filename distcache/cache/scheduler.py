"""`Scheduler`: the look-ahead window of one cache, and the plan that stages each batch.

Data flow of one batch through the scheduler::

    enqueue(ids)        the batch enters the window: deduplicated, linked to its rows' earlier
                        uses; the policy learns which resident rows it uses next
    stage_next()        hits pinned; victims chosen among unpinned slots; StagePlan emitted
                        (write back dirty victims, then load the misses into their slots)
    ... the stager executes the plan, the batch is looked up, trained ...
    release(plan)       the batch's slots are unpinned (and marked dirty if it was trained)

Nothing here waits for the device. Every tensor has a shape the host knows (the batch's id count
n, the cache's capacity C); what only the device knows (how many rows miss, how many victims are
dirty) stays there as counts, and plans are padded with the sentinel row and slot
(`Residency`). One count does come to the host: how many distinct rows a batch has, copied when
it enters the window and read when it is staged, batches later in a pipeline (the newest batch
in the window is staged without it): its plan then covers its m distinct rows instead of its n
ids (`_stage_size`; a third of them on a power-law trace). Counters accumulate on the device and
are read only by `counters`. The per-batch work is O(n) to enter the window and O(m) to stage,
plus the victims' histogram of a bounded number of classes once the cache may be full
(`Victims`: the policy scores a few candidates per row, never every slot); it grows neither
with the window's length nor with the cache's capacity.

Each call is host bookkeeping (the window's deques, seqs, ring positions, which path to take)
around a device function of tensors only (`_enqueue_device`, `_stage_device`), which takes the
batch's seq and ring position from a small device tensor, so that it dispatches the same ops
with the same host values for every batch of a size. With `graphs` those functions run as
captured graphs (`GraphCache`, `CacheConfig.cuda_graphs`): one launch instead of a hundred-odd.
With `fused` most of their passes run as a few Triton kernels instead of torch ops (`fused`,
`CacheConfig.fused`): `_look_up` and `_place` are the torch ops that `fused.look_up` and
`fused.place` replace, and the reference they are tested against.

Errors that only the device can detect cannot be raised here without a read-back, so they are
recorded in the plan (`StagePlan.counts`) with a guarantee that nothing wrong is written: a
batch whose misses do not fit gets the slots there are, its other rows read the sentinel slot,
and every evicted dirty row is still written back. The engine raises the error when the plan's
counts reach the host, before the batch is looked up.
"""

from __future__ import annotations

import functools
from collections import deque

import torch
import torch.nn.functional as F

from distcache.cache import fused as fused_passes
from distcache.cache.counters import Counters
from distcache.cache.graphs import GraphCache, padded_size
from distcache.cache.plan import (
    CANDIDATES,
    EVICTIONS,
    FREE,
    LOADS,
    MISSES,
    NUM_COUNTS,
    UNIQUE,
    WRITEBACKS,
    StagePlan,
)
from distcache.cache.policies import EvictionPolicy, LookaheadPolicy
from distcache.cache.residency import NO_USE, Residency
from distcache.cache.select import pack
from distcache.cache.streams import HostCopy
from distcache.cache.victims import Victims
from distcache.cache.window import Window, WindowBatch, check_room
from distcache.errors import CacheCapacityError, LookaheadWindowError

# `Victims` sweeps at least MIN_SCAN slots: caches up to that size are swept whole (below it a
# sweep costs less than its launches, and small caches choose as if every slot were scored).
MIN_SCAN = 4096

# `Scheduler._totals`: ids, critical misses, then the plans' `counts` summed (one add a plan).
_IDS, _CRITICAL, _PLANS = 0, 1, 2


class Scheduler:
    """Look-ahead window and residency bookkeeping for one cache.

    Args:
        num_rows: rows of the shard; ids must lie in [0, num_rows), or be the sentinel row
            `num_rows` (padding, invalid ids: they read zeros and are never loaded).
        capacity: cache slots, 1 <= capacity <= num_rows.
        policy: the eviction policy (bound here to the sizes).
        lookahead: L, future batches that may be enqueued beyond the one training.
        device: where ids and maps live.
        name: the table or table group, for error messages.
        graphs: replay the device work of `enqueue` and of `stage_next` (once the cache may be
            full) as graphs captured per batch size (`CacheConfig.cuda_graphs`; on CPU an
            emulation, for tests). Once batches come in more than one size, each is padded with
            the sentinel row to `graphs.size(n)` ids; plans give back `id_slots` and `inverse`
            of its own n.
        exact: the policy scores every slot for every batch (O(capacity) a batch: for
            Belady's optimum in the simulator), instead of the candidates of `Victims`.
        fused: run the passes `distcache.cache.fused` fuses as its kernels
            (`CacheConfig.fused`).
    """

    def __init__(
        self,
        num_rows: int,
        capacity: int,
        policy: EvictionPolicy,
        *,
        lookahead: int,
        device: torch.device | str = "cpu",
        name: str = "cache",
        graphs: bool = False,
        exact: bool = False,
        fused: bool = False,
    ):
        device = torch.device(device)
        if not 1 <= capacity <= num_rows:
            raise CacheCapacityError(f"{name}: capacity {capacity} must be in [1, {num_rows}]")
        self.name = name
        self.num_rows = num_rows
        self.capacity = capacity
        self.lookahead = lookahead
        self.policy = policy
        self.device = device
        self.exact = exact
        # Every row has a slot of its own (row r in slot r), all loaded before the first batch
        # (`fill_whole`): no loads, victims, pins or next uses.
        self.whole = capacity == num_rows
        self.residency = Residency(num_rows, capacity, device)
        self.window = Window(num_rows, device)
        self.victims = Victims(self.residency, policy)
        self._totals = torch.zeros(_PLANS + NUM_COUNTS, dtype=torch.int64, device=device)
        # Ones and minus ones to count with (`index_add_` of a stride-0 view: no fill per batch).
        self._one = torch.ones(1, dtype=torch.int32, device=device)
        self._minus_one = torch.full((1,), -1, dtype=torch.int32, device=device)
        self._unstaged: deque[WindowBatch] = deque()
        self._staged: deque[StagePlan] = deque()
        self._batches = 0
        # A whole cache's plans' transfer lists, by size: the sentinel row (and slot) alone.
        self._no_transfers: dict[int, torch.Tensor] = {}
        self.graphs = GraphCache(device, enabled=graphs, name=name)
        self._kernels = fused_passes.kernels(device, graphs=graphs) if fused else None
        self.victims.kernels = self._kernels
        self.clear()

    # ---------------------------------------------------------------- window
    @property
    def kernels(self) -> dict | None:
        """The fused passes' kernels (`fused.kernels`), or None where they are off."""
        return self._kernels

    @property
    def num_unstaged(self) -> int:
        return len(self._unstaged)

    @property
    def num_staged(self) -> int:
        """Batches staged and not yet released (their rows are pinned)."""
        return len(self._staged)

    @property
    def staged(self) -> tuple[StagePlan, ...]:
        return tuple(self._staged)

    def check_room(self) -> None:
        """Raise `LookaheadWindowError` if one more batch would overflow the window."""
        check_room(self.name, len(self._unstaged) + len(self._staged), self.lookahead)

    def enqueue(self, ids: torch.Tensor) -> int:
        """Add the next batch's ids `[n]` (int64 rows in range, or the sentinel row) to the
        window; returns its seq."""
        self.check_room()
        seq = self._next_seq
        self._next_seq += 1
        num_ids = ids.numel()
        n = self.graphs.size(num_ids)
        if n > num_ids:  # a few sizes for the graphs: the sentinel row is padding already
            ids = F.pad(ids, (0, n - num_ids), value=self.residency.sentinel_row)
        base = self.window.reserve(n)
        at = self._device_ints(seq, base)
        work = self._current_graphs().run(("enqueue", n), self._enqueue_device, ids, at)
        # Read when it is staged after a later batch entered (`_stage_size`): never for a cache
        # of every row (its rows are not packed), nor in a window of one batch (L = 0).
        distinct = None if self.whole or not self.lookahead else HostCopy(work[4])
        self._unstaged.append(self.window.enter(seq, base, at, work[:4], num_ids, distinct))
        self._batches += 1
        return seq

    def _current_graphs(self) -> GraphCache:
        """The graphs, forgotten if the window's ring was replaced since they were captured."""
        if self._graphs_window != self.window.generation:
            self.graphs.clear()
            self._graphs_window = self.window.generation
        return self.graphs

    def _enqueue_device(self, ids: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`enqueue`'s device work: the window's, the policy's, the id count."""
        found, ids_total = self._kernels, self._totals.select(0, _IDS)
        if found is not None and not self.whole:
            return fused_passes.enter(found, self.window, self.residency, ids_total, ids, at)
        if found is not None and "distinct" in found:  # (the C kernels)
            return fused_passes.distinct(found, self.window, ids_total, ids, at)
        real = ids != self.residency.sentinel_row
        ids_total.add_(real.sum())
        if self.whole:  # no next use is read, no sort (`_stage_whole`)
            return self.window.distinct_device(ids, at, real)
        rows, inv, valid, positions, fresh, distinct = self.window.enter_device(ids, at)
        # The resident rows this batch is the first in the window to use: their next use.
        res = self.residency
        slot = res.slot_of.index_select(0, rows).long()
        into = torch.where(fresh & (slot >= 0), slot, res.trash_slot)
        res.next_use.scatter_(0, into, at[0].expand(rows.numel()))
        return rows, inv, valid, positions, distinct

    # ---------------------------------------------------------------- staging
    def stage_next(self, *, critical: bool = False) -> StagePlan:
        """Plan the oldest enqueued batch's staging and update residency as if it were done."""
        if not self._unstaged:
            raise LookaheadWindowError(f"{self.name}: no enqueued batch left to stage")
        batch = self._unstaged.popleft()
        self.window.leave(batch)
        n, known = self._stage_size(batch)
        # Its packed rows up to n: the rest is the sentinel row (padding of `Window`'s packing).
        inputs = (batch.rows[:n], batch.inv, batch.valid[:n], batch.positions[:n], batch.at)
        if self.whole:
            if not self._filled:
                raise LookaheadWindowError(
                    f"{self.name}: a cache of every row stages batches once its rows are "
                    "loaded: call fill_whole() after loading row r into slot r"
                )
            work = self._current_graphs().run(("whole", n), self._stage_whole, *inputs)
        elif self._free_slots_suffice(n):  # filling: no victims to choose, not captured
            work = self._stage_device(*inputs, fill=True)
        else:
            scan, full = self._scan(n), self._full
            key = ("stage", batch.size, n, scan, full)  # (its ids: `inv`; its rows: n)
            stage = functools.partial(self._stage_device, scan=scan, full=full)
            # (An unknown size, the device behind: a shape that should not wait for a capture.)
            work = self._current_graphs().run(key, stage, *inputs, capture=known)
        slots, id_slots, load_rows, load_slots, writeback_rows, writeback_slots, counts = work
        if critical:
            self._totals.select(0, _CRITICAL).add_(counts[MISSES])
        plan = StagePlan(
            seq=batch.seq,
            batch=batch,
            slots=slots,
            id_slots=id_slots[: batch.num_ids],
            load_rows=load_rows,
            load_slots=load_slots,
            writeback_rows=writeback_rows,
            writeback_slots=writeback_slots,
            counts=counts,
            critical=critical,
            pinned_batches=len(self._staged),
            moves=not self.whole,
        )
        self._staged.append(plan)
        return plan

    def _stage_size(self, batch: WindowBatch) -> tuple[int, bool]:
        """How many of a batch's packed rows its plan covers: its distinct rows (and the
        sentinel row, if it has padding), whose count reached the host when a later batch
        entered the window (`WindowBatch.distinct`: in a pipeline it was copied batches ago,
        so reading it waits for nothing); rounded up to a few sizes (`padded_size`) when
        graphs replay the plans. Every pass of the plan then follows the batch's distinct rows,
        not its ids. All of them for a cache of every row, whose rows are not packed, and for
        the newest batch in the window: its count may not have reached the host yet, and
        reading it then would wait for the device. Nor is an older batch's count waited for:
        where its copy has not completed (the device runs behind), the plan covers all of them.
        Also whether the count was read (False: all of them for want of it)."""
        if batch.distinct is None or batch.seq == self._next_seq - 1:
            return batch.size, True
        done = batch.distinct.read_if_done()
        if done is None:
            return batch.size, False
        distinct = done[0]
        if self.graphs.enabled:
            distinct = padded_size(distinct)
        return min(batch.size, distinct), True

    def _stage_device(
        self,
        rows: torch.Tensor,
        inv: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        at: torch.Tensor,
        *,
        fill: bool = False,
        scan: int = 0,
        full: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """`stage_next`'s device work for a batch (`WindowBatch`'s tensors): the plan's
        tensors, `StagePlan.slots` to `counts`. `fill`: the misses take free slots in order;
        else `Victims.choose` picks them, sweeping `scan` slots (`full`: known to have no
        free slot left, so none is offered)."""
        res, n = self.residency, rows.numel()
        size = min(n, self.capacity)
        found = self._kernels if n else None  # (the kernels need a row)
        if found is None:
            looked_up = self._look_up(rows, positions)
        else:
            looked_up = fused_passes.look_up(found, self.window, res, rows, positions)
        want = looked_up[-1]
        seq = at[0]  # on the device
        if fill:
            victims, taken, candidates = self._free_victims(want, size)  # [size + 1]
        else:
            victims, taken, candidates = self.victims.choose(
                seq, want, size, self._fill, scan, free=not full
            )
        uses = self.policy.uses if isinstance(self.policy, LookaheadPolicy) else None
        if found is None:
            placed = self._place(rows, looked_up, victims, taken, size)
        else:
            placed = fused_passes.place(found, res, rows, looked_up, victims, taken, size, uses)
        slot, got, old, evicted, writeback, loads = placed
        if found is None or uses is None:  # (else the kernel did it)
            self.policy.on_stage(seq, rows, slot, got)

        if found is not None and "finish" in found:  # (the C kernels)
            done = fused_passes.finish(
                found, valid, slot, inv, (old, evicted, writeback), victims,
                (want, taken, candidates), self._fill, self.capacity, self._totals[_PLANS:],
            )  # fmt: skip
            return slot, done[0], loads, victims[:size], *done[1:]
        unique = valid.sum()
        # The dirty victims, packed; padding points at victims[size], the sentinel slot (and row).
        wb_at = torch.nonzero_static(writeback, size=size, fill_value=size).squeeze(1)
        free = self.capacity - self._fill  # (`choose` moved `fill` past the free slots taken)
        counts = torch.stack(
            [unique, want, taken, writeback.sum(), evicted.sum(), candidates, free]
        )
        self._totals[_PLANS:].add_(counts)
        return (
            slot,
            slot.index_select(0, inv),
            loads,
            victims[:size],
            old.index_select(0, wb_at),
            victims.index_select(0, wb_at),
            counts,
        )

    def _look_up(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A staging batch's `[m]` rows leave the window and are looked up: each row's next use,
        whether it misses, its slot (the sentinel slot for a miss), pinned, and the misses
        (0-dim). (`fused.look_up` in one kernel.)"""
        res, n = self.residency, rows.numel()
        next_use = self.window.leave_device(rows, positions)  # [n] each row's next use
        # [n] -1: not resident. The sentinel row (padding) always sits in the sentinel slot
        # (`Residency`), so it is never a miss, and pinning it is harmless.
        slot = res.slot_of.index_select(0, rows).long()
        miss = slot < 0
        want = miss.sum()
        hit_slots = torch.where(miss, res.sentinel_slot, slot)
        res.pin.index_add_(0, hit_slots, self._one.expand(n))
        return next_use, miss, hit_slots, want

    def _place(
        self,
        rows: torch.Tensor,
        looked_up: tuple[torch.Tensor, ...],
        victims: torch.Tensor,
        taken: torch.Tensor,
        size: int,
    ) -> tuple[torch.Tensor, ...]:
        """The plan's residency updates: the k-th miss takes the k-th victim (k < taken),
        whose row is evicted (written back if dirty). Each row's slot, which rows got a victim,
        the victims' old rows, which were evicted and written back, and the rows to load.
        (`fused.place` in two kernels.)"""
        res, n = self.residency, rows.numel()
        next_use, miss, hit_slots, _ = looked_up
        rank = miss.cumsum(0, dtype=torch.int32) - 1  # (int32: a bool cumsum to int64 is 6x slower)
        got = miss & (rank < taken)  # misses that get a slot (all of them unless overflow)
        # [n] each row's slot: its victim, where it is, or for a miss without a victim (the
        # cache overflowed: an error at lookup) the sentinel slot.
        slot = torch.where(got, victims.index_select(0, rank.clamp(0, size)), hit_slots)

        old = res.row_of.index_select(0, victims)  # [size + 1] the victims' rows (-1: free)
        real = victims < self.capacity
        evicted = real & (old >= 0)
        writeback = evicted & res.dirty.index_select(0, victims)
        res.slot_of.index_fill_(0, torch.where(evicted, old, res.trash_row), -1)
        res.slot_of.scatter_(0, torch.where(got, rows, res.trash_row), slot.int())
        res.row_of.scatter_(0, torch.where(got, slot, res.trash_slot), rows)
        res.dirty.index_fill_(0, victims, False)
        loaded_slots = torch.where(got, slot, res.sentinel_slot)
        res.pin.index_add_(0, loaded_slots, self._one.expand(n))
        res.next_use.scatter_(0, slot, next_use)
        loads = pack(got, rank, rows, size, res.sentinel_row)
        return slot, got, old, evicted, writeback, loads

    def _stage_whole(
        self,
        rows: torch.Tensor,
        inv: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        at: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """`_stage_device` for a cache that holds every row, all loaded (`fill_whole`): row r
        is in slot r (the sentinel row in the sentinel slot), so a batch's slots are its rows
        and its plan moves nothing (nothing loaded, evicted, written back, scored or pinned, no
        next use kept: the window only deduplicates), the same plan tensors, transfers empty."""
        size = min(rows.numel(), self.capacity)
        none = self._no_transfers.get(size)  # (read only, by the stager: made once a size)
        if none is None:
            none = self._no_transfers[size] = rows.new_full((size,), self.residency.sentinel_row)
        if "finish_whole" in (self._kernels or {}):  # (the C kernels)
            done = fused_passes.finish_whole(self._kernels, valid, rows, inv, self._totals[_PLANS:])
            return rows, done[0], none, none, none, none, done[1]
        counts = F.pad(valid.sum().view(1), (0, NUM_COUNTS - 1))  # unique; nothing else
        self._totals[_PLANS:].add_(counts)
        return rows, rows.index_select(0, inv), none, none, none, none, counts

    def fill_whole(self) -> None:
        """A cache of every row: the caller has loaded row r into slot r for every row (once
        after `clear()`, before the first batch is staged; O(capacity), on the current stream).
        From here on no plan loads a row."""
        if not self.whole:
            raise CacheCapacityError(
                f"{self.name}: fill_whole() fills a cache of every row; this one holds "
                f"{self.capacity} of {self.num_rows}"
            )
        res, cap = self.residency, self.capacity
        every = torch.arange(cap, device=self.device)
        res.slot_of[:cap].copy_(every)
        res.row_of[:cap].copy_(every)
        self._fill.fill_(cap)
        self._fill_bound, self._full, self._filled = cap, True, True

    @property
    def needs_fill(self) -> bool:
        """A cache of every row whose rows have not been loaded since `clear()`."""
        return self.whole and not self._filled

    def release(self, plan: StagePlan, *, updated: bool = True) -> None:
        """The batch of `plan` is done: unpin its slots; `updated`: it was trained, so its rows
        are dirty."""
        if not self._staged or self._staged[0] is not plan:
            raise LookaheadWindowError(
                f"{self.name}: batches must be released in the order they were staged"
            )
        self._staged.popleft()
        res = self.residency
        if not self.whole:  # (a cache of every row pins nothing: it never evicts)
            res.pin.index_add_(0, plan.slots, self._minus_one.expand(plan.slots.numel()))
        if updated:
            res.dirty.index_fill_(0, plan.slots, True)

    def note_counts(self, counts: list[int]) -> None:
        """A looked-up plan's host-mirrored `counts`: once one leaves no free slot, later
        batches choose victims without free-slot candidates (slots are freed only by
        `clear()`)."""
        if counts[FREE] == 0:
            self._full = True

    def capacity_error(self, plan: StagePlan, counts: list[int]) -> CacheCapacityError | None:
        """The error for a plan whose host-mirrored `counts` show that its misses did not fit,
        else None."""
        if counts[LOADS] == counts[MISSES]:
            return None
        unique, misses, available = counts[UNIQUE], counts[MISSES], counts[CANDIDATES]
        if unique > self.capacity:
            return CacheCapacityError(
                f"{self.name}: a batch uses {unique} distinct rows but the cache holds "
                f"{self.capacity}; all of a batch's rows must be resident when it is looked "
                f"up. Use a capacity of at least {unique} rows (more to stage batches ahead)."
            )
        pinned = self.capacity - available
        return CacheCapacityError(
            f"{self.name}: cache too small to stage batch {plan.seq}: it needs {misses} more "
            f"rows but only {available} of {self.capacity} slots can be evicted; {pinned} slots "
            f"are pinned by the {plan.pinned_batches} batch(es) in flight. The batches in flight "
            f"use at least {pinned + unique} distinct rows. Use a capacity of at least "
            f"{pinned + unique} rows, or a smaller prefetch_depth."
        )

    def drop_window(self) -> None:
        """Forget every batch in the window (after an error): rows stay resident, dirty rows
        stay dirty, every pin is released."""
        self._unstaged.clear()
        self._staged.clear()
        self.window.clear()
        res = self.residency
        res.unpin_all()
        res.next_use.fill_(NO_USE)  # no batch uses a row now

    def clear(self) -> None:
        """Forget every resident row and every batch in the window (after a reload)."""
        self.residency.clear()
        self.window.clear()
        self.policy.bind(self.residency, self.lookahead)
        self.victims.clear()
        self._unstaged.clear()
        self._staged.clear()
        self._next_seq = 0  # the policy was re-bound: sequence numbers start again
        # Slots are handed out in order and only `clear()` frees them, so the free slots are
        # always [fill, capacity); `_fill_bound` bounds `fill` on the host.
        self._fill = torch.zeros((), dtype=torch.int64, device=self.device)
        self._fill_bound = 0
        self._full = False  # the host has seen a plan leave no free slot (`note_counts`)
        self._filled = False  # a cache of every row: its rows are loaded (`fill_whole`)
        self.graphs.clear()  # they captured the policy's tensors, re-bound above
        self._graphs_window = self.window.generation

    @property
    def counters(self) -> Counters:
        """The counters since the scheduler was built (reads the device: not per batch)."""
        totals = self._totals.tolist()
        plans = totals[_PLANS:]
        return Counters(
            batches=self._batches,
            ids=totals[_IDS],
            unique=plans[UNIQUE],
            hits=plans[UNIQUE] - plans[MISSES],
            loads=plans[LOADS],
            writebacks=plans[WRITEBACKS],
            evictions=plans[EVICTIONS],
            critical_misses=totals[_CRITICAL],
        )

    # ---------------------------------------------------------------- victims
    def _device_ints(self, *values: int) -> torch.Tensor:
        """`values` as an int32 tensor on the device, copied from page-locked host memory
        without waiting (the pinned block is not reused before the copy has run)."""
        host = torch.tensor(values, dtype=torch.int32)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _free_slots_suffice(self, n: int) -> bool:
        """Host-side: whether the free slots can take a batch of `n` ids' misses, which is
        known while every batch so far loaded at most its id count (slots are handed out in
        order and only `clear()` frees them, so the free ones are always [fill, capacity);
        `_fill_bound` bounds `fill`). (A cache of every row stages by `_stage_whole`.)"""
        cap = self.capacity
        if self._fill_bound + n <= cap:
            self._fill_bound = min(self.num_rows, self._fill_bound + n)
            return True
        self._fill_bound = self.num_rows
        return False

    def _free_victims(
        self, want: torch.Tensor, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slots for `want` misses while the free ones suffice: the next free slots, `[size +
        1]` (then the sentinel slot), how many were chosen, how many were free."""
        index = torch.arange(size + 1, device=self.device)
        victims = torch.where(index < want, self._fill + index, self.residency.sentinel_slot)
        free = self.capacity - self._fill
        self._fill = self._fill + want
        return victims, want, free

    def _scan(self, n: int) -> int:
        """Host-side: the slots `Victims` sweeps for a plan of `n` rows: enough that the
        unpinned ones among them cover its misses (the staged plans pin at most their rows,
        this one at most n, and it misses at most n), at least `MIN_SCAN`; the whole cache
        when that would be within 2 n of it (scoring every slot then costs little more, and is
        the policy's exact choice), and when `exact`; a few sizes when graphs replay it."""
        if self.exact:
            return self.capacity
        pinned = sum(plan.slots.numel() for plan in self._staged) + n
        scan = padded_size(pinned + n) if self.graphs.enabled else pinned + n  # (few graphs)
        if scan + 2 * min(n, self.capacity) >= self.capacity:  # every slot
            return self.capacity
        return max(MIN_SCAN, scan)
