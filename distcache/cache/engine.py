"""`CacheEngine`: one shard's host store, device cache, scheduler, stager and optimizer.

A shard is one or more tables of the same width whose rows are concatenated into one id space
(table t's row r is engine row `row_offset[t] + r`), so one cache serves them all and the hot
rows of any table compete for the same slots.

The per-batch path (`enqueue`, `prefetch`, `lookup_plan`, `apply_gradients` or
`apply_tbe_gradients`, `release`) never reads the device back on the training thread: the
scheduler runs on its own stream with fixed-shape buffers, the stager's worker thread moves rows
and is the only one that waits (on CUDA; on CPU a plan's copies run when it is submitted), and a
lookup waits for its rows on the device (an event). What the device alone knows (a cache too
small for the batches in flight, invalid ids flagged by the caller) reaches the host with the
plan's counts, which the worker has already waited for; the error is raised at the batch's
lookup, before it reads a row, after every evicted dirty row has been written back.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import torch

from distcache.cache import fused
from distcache.cache.config import CacheConfig
from distcache.cache.counters import CacheStats
from distcache.cache.host_store import HostStore
from distcache.cache.lane import Lane
from distcache.cache.optimizers import make_optimizer, round_stochastically
from distcache.cache.plan import StagePlan
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.cache.stager import Stager
from distcache.cache.streams import Streams
from distcache.cache.tbe import TbeKernel, kernel_for
from distcache.cache.window import check_room
from distcache.errors import DistcacheConfigError, LookaheadWindowError

#: The dtypes rows may have (a TorchRec table's `data_type`: FP32, FP16, BF16).
ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CacheEngine:
    """The cache of one shard.

    Args:
        num_rows: rows of the shard (all of its tables).
        dim: row width.
        config: cache settings (capacity, L, K, policy, optimizer).
        device: where the cache and its maps live.
        name: the shard, for messages.
        capacity: cache rows (default: `config.capacity_rows(num_rows)`).
        dtype: the rows' dtype in the host store, the cache and on the wire (float32, or
            float16 / bfloat16 for half the bytes). The optimizer state stays float32, and an
            update is computed in float32 and rounded (`CacheConfig.stochastic_rounding`).
        pooled: the cache's lookups pool bags (`CachedEmbeddingBags`), rather than return
            each id's row (`CachedEmbeddings`); FBGEMM's kernel is built for one or the other.
    """

    def __init__(
        self,
        *,
        num_rows: int,
        dim: int,
        config: CacheConfig,
        device: torch.device | str = "cpu",
        name: str = "cache",
        capacity: int | None = None,
        dtype: torch.dtype = torch.float32,
        pooled: bool = True,
    ):
        if dtype not in ROW_DTYPES:
            raise DistcacheConfigError(
                f"{name}: rows of dtype {dtype} are not supported: expected one of {ROW_DTYPES}"
            )
        device = torch.device(device)
        self.name = name
        self.config = config
        self.dim = dim
        self.device = device
        self.streams = Streams(device)
        self.optimizer = make_optimizer(config)
        state_dim = self.optimizer.state_dim(dim)
        self.store = HostStore(
            num_rows, dim, state_dim, dtype=dtype, pin_memory=device.type == "cuda"
        )
        capacity = config.capacity_rows(num_rows) if capacity is None else capacity
        # Two more rows: the sentinel slot (padding and invalid ids read its zeros) and the
        # trash slot (direct staging's padding lands there; nothing reads it).
        slots = capacity + 2
        self.kernel = kernel_for(config, device, dtype, dim)
        self._stochastic = dtype != torch.float32 and config.rounds_stochastically(device)
        # FBGEMM's TBE over the slots (`kernel='fbgemm'`): its tensors are the cache's rows.
        self.tbe: TbeKernel | None = None
        if self.kernel == "fbgemm":
            self.tbe = TbeKernel(
                slots=slots, dim=dim, dtype=dtype, config=config, optimizer=self.optimizer,
                device=device, pooled=pooled,
            )  # fmt: skip
            self.weights, self.state = self.tbe.weights, self.tbe.state
        else:
            self.weights = torch.zeros(slots, dim, dtype=dtype, device=device)
            self.state = torch.zeros(slots, state_dim, device=device)
        # weights: [capacity + 2, dim]; state: [capacity + 2, state_dim] float32
        self.scheduler = Scheduler(
            num_rows,
            capacity,
            make_policy(config.policy),
            lookahead=config.lookahead,
            device=device,
            name=name,
            graphs=config.graphs_on(device),
            fused=config.fused_on(device),
        )
        # The C kernels' SGD step and row copies (`fused.sgd`, `fused.move`), where the
        # scheduler runs them (CPU).
        found = self.scheduler.kernels or {}
        self._sgd = found.get("sgd") if self.kernel == "torch" else None
        direct = config.staging_on(device) == "direct"
        self.stager = Stager(
            self.store,
            self.weights,
            self.state,
            self.streams,
            direct=direct,
            move=found.get("move"),
        )
        self._checks: dict[int, torch.Tensor] = {}  # seq -> caller's check words, until staged
        # The scheduling calls (enqueue, staging, releases), on the training thread or on a
        # thread of their own (`CacheConfig.scheduler_thread`); the engine's own counts
        # answer the training thread meanwhile.
        self._lane = Lane(self.streams.index, threaded=config.scheduler_thread, name=name)
        self._window = _Window()
        # Staged, not yet looked up: their plans (inline) or futures of them (the lane's thread).
        self._ahead: deque[Future[StagePlan] | StagePlan] = deque()
        self._active: deque[StagePlan] = deque()  # looked up, not yet released
        self._staging_s = 0.0
        self._wait_s = 0.0

    @property
    def capacity(self) -> int:
        return self.scheduler.capacity

    @property
    def pool_kernels(self) -> dict | None:
        """The C kernels, where they pool this cache's rows straight into the module's output
        (`fused.pool`: fp32 rows, distcache's kernel, CPU); else None."""
        found = self.scheduler.kernels
        fp32 = self.weights.dtype == torch.float32
        return found if self._sgd is not None and fp32 and "pool" in found else None

    # ------------------------------------------------------------ batch flow
    def check_room(self) -> None:
        """Raise `LookaheadWindowError` if the window cannot take one more batch (as
        `Scheduler.check_room`, from the engine's counts)."""
        in_window = self._window.enqueued - self._window.released
        check_room(self.name, in_window, self.config.lookahead)

    def enqueue(self, ids: torch.Tensor, check: torch.Tensor | None = None) -> int:
        """Add a future batch's engine rows `[n]` (int64, in range or the sentinel row
        `num_rows`) to the look-ahead window; returns its seq.

        `check`: device int64 words the caller wants back on the host with the batch's plan
        (`StagePlan.host_check` after `lookup_plan`), e.g. an invalid-id record.
        """
        self.check_room()
        s = self.streams
        produced = s.record()  # the ids are made on the current stream
        s.keep_for(ids, s.schedule)
        seq = self._window.enqueued
        self._lane.submit(self._enqueue, ids, produced, seq)
        self._window.enqueued += 1
        if check is not None:
            # Copied to the host on the schedule stream when the batch is staged: its memory
            # must not go back to the current stream's pool before that copy has run.
            s.keep_for(check, s.schedule)
            self._checks[seq] = check
        return seq

    def _enqueue(self, ids: torch.Tensor, produced: torch.cuda.Event | None, seq: int) -> None:
        s = self.streams
        with s.on(s.schedule):
            s.wait(produced)
            made = self.scheduler.enqueue(ids)
        if made != seq:  # the engine's count and the scheduler's must agree
            raise LookaheadWindowError(f"{self.name}: batch {made} entered as batch {seq}")

    def prefetch(self, depth: int | None = None) -> int:
        """Stage enqueued batches until `depth` (default: the config's `prefetch_depth`) are
        staged ahead of the training one.

        A no-op for reactive policies, which load their misses when a batch is looked up.
        Returns the number of batches staged.
        """
        if self.config.is_reactive:
            return 0
        depth = self.config.prefetch_depth if depth is None else depth
        staged = 0
        start = time.perf_counter()
        while len(self._ahead) < depth and self._window.unstaged:
            self._ahead.append(self._submit_stage(critical=False))
            staged += 1
        if staged:
            self._staging_s += time.perf_counter() - start
        return staged

    def lookup_plan(self) -> StagePlan:
        """The next batch's plan, its rows resident (on the device once the current stream
        gets there): staged ahead, or staged now (critical).

        Raises `CacheCapacityError` if the batch's rows did not fit (the window is then
        dropped: nothing is lost, the rows in the cache stay there).
        """
        self.release_stale()
        start = time.perf_counter()
        if self._ahead:
            staged = self._ahead.popleft()
        elif self._window.unstaged:
            staged = self._submit_stage(critical=True)
        else:
            raise LookaheadWindowError(f"{self.name}: lookup with no enqueued batch")
        plan = self._lane.result(staged)
        plan.host_counts, plan.host_check = self.stager.wait(plan)
        self._wait_s += time.perf_counter() - start
        self._active.append(plan)
        self._lane.submit(self.scheduler.note_counts, plan.host_counts)
        error = self.scheduler.capacity_error(plan, plan.host_counts)
        if error is not None:
            self.drop_window()
            raise error
        return plan

    def apply_gradients(
        self,
        plan: StagePlan,
        bag_grad: torch.Tensor,
        bag_of_id: torch.Tensor | None,
        id_weights: torch.Tensor | None = None,
        batch_major: tuple[int, int] | None = None,
    ) -> None:
        """Fused optimizer step on the batch's rows (the torch kernel's).

        Args:
            plan: the batch's staging plan (its rows are pinned).
            bag_grad: gradient of each pooled bag `[bags, dim]` (mean scaling applied).
            bag_of_id: the bag of each id `[n]`; None when each id is its own bag (unpooled
                lookups: `bag_grad` is then the gradient of each id's row `[n, dim]`).
            id_weights: each id's weight `[n]` (weighted features): its row's gradient is its
                bag's gradient times the weight.
            batch_major: (batch, features): `bag_grad` is `[batch, features * dim]`, feature
                f's bag b at row b (`fused.pool`'s layout; bag f * batch + b).
        """
        self._check_active(plan)
        sgd = self.optimizer.per_id and self.weights.dtype == torch.float32
        if (
            sgd
            and self._sgd is not None
            and bag_grad.dtype == torch.float32
            and (id_weights is None or id_weights.dtype == torch.float32)
        ):  # SGD in one C kernel (CPU), the torch ops' below; it reads `batch_major` as it is
            fused.sgd(
                self._sgd, self.weights, bag_grad, bag_of_id, id_weights, plan.id_slots,
                self.optimizer.lr, batch_major,
            )  # fmt: skip
            self._updated(plan)
            return
        if batch_major is not None:  # each bag's gradient in a row of its own, bag by bag
            batch, features = batch_major
            bag_grad = bag_grad.view(batch, features, -1).transpose(0, 1).reshape(-1, self.dim)
        if sgd:
            # Stateless and linear (SGD): scatter-add each id's step -lr * g, as a sparse SGD
            # step does. Scaling the few bags first is cheaper than index_add_(alpha=...).
            step = bag_grad * -self.optimizer.lr
            if bag_of_id is not None:
                step = step.index_select(0, bag_of_id)  # [n, dim]
            if id_weights is not None:
                step = step * id_weights.unsqueeze(1)
            self.weights.index_add_(0, plan.id_slots, step)
        else:
            # Summed per row at its representative; other entries (duplicates, padding) stay
            # zero and update the sentinel slot, which is zeroed below.
            grad = torch.zeros(plan.slots.numel(), self.dim, device=bag_grad.device)
            per_id = bag_grad if bag_of_id is None else bag_grad.index_select(0, bag_of_id)
            if id_weights is not None:
                per_id = per_id * id_weights.unsqueeze(1)
            grad.index_add_(0, plan.inverse, per_id)
            # In float32 (a copy for half rows), rounded when written back
            # (`CacheConfig.stochastic_rounding`).
            weights = self.weights.index_select(0, plan.slots).float()
            state = self.state.index_select(0, plan.slots)
            self.optimizer.update(weights, state, grad)
            if self._stochastic:
                rounded = round_stochastically(weights, self.weights.dtype)
            else:
                rounded = weights.to(self.weights.dtype)
            self.weights.index_copy_(0, plan.slots, rounded)
            self.state.index_copy_(0, plan.slots, state)
        self._updated(plan)

    def apply_tbe_gradients(
        self, plan: StagePlan, output: torch.Tensor, grad: torch.Tensor
    ) -> None:
        """Fused optimizer step on the batch's rows by FBGEMM's backward (`kernel='fbgemm'`).

        Args:
            plan: the batch's staging plan (its rows are pinned).
            output: the batch's lookup as `TbeKernel.lookup` returned it under grad mode.
            grad: its gradient (mean scaling applied).
        """
        self._check_active(plan)
        self.tbe.update(output, grad)
        self._updated(plan)

    def _check_active(self, plan: StagePlan) -> None:
        """Refuse to update rows that may already hold other rows (before any change)."""
        if plan not in self._active:
            raise LookaheadWindowError(
                f"{self.name}: backward of batch {plan.seq} ran after its rows were released "
                "(a later forward started first). distcache updates rows in backward: run "
                "backward before the next forward."
            )

    def _updated(self, plan: StagePlan) -> None:
        """After a batch's update: the sentinel slot back to zeros (padding and duplicates
        may have updated it), the optimizer's step counted, the batch released."""
        sentinel = self.scheduler.residency.sentinel_slot
        self.weights[sentinel].zero_()
        if self.state.shape[1]:
            self.state[sentinel].zero_()
        self.optimizer.step()
        self.release(plan, updated=True)

    def release(self, plan: StagePlan, *, updated: bool = False) -> None:
        """The batch is done: unpin its rows (`updated`: it was trained, its rows are dirty)."""
        self._active.remove(plan)
        done = self.streams.record()  # after the batch's lookup (and update) on this stream
        self._lane.submit(self._release, plan, updated, done)
        self._window.released += 1

    def _release(self, plan: StagePlan, updated: bool, done: torch.cuda.Event | None) -> None:
        s = self.streams
        with s.on(s.schedule):
            s.wait(done)
            self.scheduler.release(plan, updated=updated)
        self.stager.victims_free = done  # staging may overwrite unpinned slots after this

    def release_stale(self) -> None:
        """Release batches looked up but never backpropagated (forward without backward)."""
        while self._active:
            self.release(self._active[0])

    def _submit_stage(self, *, critical: bool) -> Future[StagePlan] | StagePlan:
        """The next batch staged (`_stage`) on the lane (`Lane.submit`)."""
        self._window.staged += 1
        return self._lane.submit(self._stage, critical)

    def _stage(self, critical: bool) -> StagePlan:
        s = self.streams
        if self.scheduler.needs_fill:  # a cache of every row: all of them, once (then no loads)
            self.stager.load_all(self.capacity)
            with self._on_schedule_after_current():
                self.scheduler.fill_whole()
        with s.on(s.schedule):
            plan = self.scheduler.stage_next(critical=critical)
            self.stager.submit(plan, self._checks.pop(plan.seq, None))
        return plan

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows `rows` `[n]` (engine rows, int64; the sentinel row reads zeros) as they are
        now, `[n, dim]` float32, read where each is (its cache slot, else the host store) on
        the current stream: nothing is staged, and the window and the residency stay as they
        are. For an evaluation's batch while training batches are in flight
        (`CachedEmbeddingBags.forward`), not the per-batch path: the host waits for the
        scheduling and the transfers in flight, as `flush` does."""
        self._lane.join()
        self.stager.drain()  # loads in place and write-backs home, once the device gets there
        s = self.streams
        s.wait(s.record(s.schedule))  # the residency as the last stage left it
        slots = self.scheduler.residency.slot_of.index_select(0, rows)
        cached = self.weights.index_select(0, slots.clamp(min=0))
        host_weights, _ = self.store.device_rows(self.device)  # its trash row last
        # Non-resident rows from the host store (the sentinel row, always resident, reads its
        # slot's zeros; its place in the store is the trash row's).
        stored = host_weights.index_select(0, rows)
        out = torch.where((slots >= 0).unsqueeze(1), cached.float(), stored.float())
        done = s.record()  # later stages overwrite no slot or host row before this read
        s.wait(done, s.schedule)
        s.wait(done, s.staging)
        return out

    # ------------------------------------------------------------ state
    def drop_window(self) -> None:
        """Forget the batches in the window after an error: their queued transfers finish
        (dirty victims reach the host store), resident rows stay, nothing is lost."""
        self._lane.join()
        self.stager.forget()
        self._ahead.clear()
        self._active.clear()
        self._checks.clear()
        with self._on_schedule_after_current():
            self.scheduler.drop_window()
        window = self._window  # every batch enqueued is gone: staged and released
        window.staged = window.released = window.enqueued

    def flush(self) -> int:
        """Write every dirty resident row back to the host store; returns rows written.

        Not part of the per-batch path: it reads the dirty bits on the host.
        """
        self._lane.join()
        self.stager.drain()
        res = self.scheduler.residency
        with self._on_schedule_after_current():
            slots = res.dirty_slots()
            self.stager.write_back(slots, res.row_of[slots])
            res.dirty[slots] = False
        return slots.numel()

    def reset(self) -> None:
        """Drop every cached row and every batch in the window (after the store was reloaded).

        Dirty rows are discarded, so call `flush()` first unless the store was just overwritten.
        """
        self._lane.join()
        self.stager.forget()
        self._ahead.clear()
        self._active.clear()
        self._checks.clear()
        with self._on_schedule_after_current():
            self.scheduler.clear()
            self.weights.zero_()
            self.state.zero_()
        self._window = _Window()  # (sequence numbers start again)

    def _on_schedule_after_current(self):  # noqa: ANN202
        s = self.streams
        s.wait(s.record(), s.schedule)
        return s.on(s.schedule)

    def stats(self) -> CacheStats:
        """The counters (reads the device: call it every few batches, not every batch)."""
        self._lane.join()
        s = self.streams
        s.wait(s.record(s.schedule))  # the counters are kept on the schedule stream
        c = self.scheduler.counters
        row_bytes = self.store.row_bytes
        return CacheStats(
            **asdict(c),
            bytes_loaded=c.loads * row_bytes,
            bytes_written=c.writebacks * row_bytes,
            capacity=self.capacity,
            num_rows=self.store.num_rows,
            staging_s=self._staging_s,
            wait_s=self._wait_s,
            graph_captures=self.scheduler.graphs.captures,
            graph_replays=self.scheduler.graphs.replays,
        )


@dataclass
class _Window:
    """The engine's counts of batches since the scheduler was cleared (its seqs), which the
    training thread reads while the lane changes the scheduler's."""

    enqueued: int = 0
    staged: int = 0
    released: int = 0

    @property
    def unstaged(self) -> int:
        return self.enqueued - self.staged
