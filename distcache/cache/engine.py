"""`CacheEngine`: one shard's host store, device cache, scheduler, stager and optimizer.

A shard is one or more tables of the same width whose rows are concatenated into one id space
(table t's row r is engine row `row_offset[t] + r`), so one cache serves them all and the hot
rows of any table compete for the same slots.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

import torch

from distcache.cache.config import CacheConfig
from distcache.cache.host_store import HostStore
from distcache.cache.optimizers import make_optimizer
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler, StagePlan
from distcache.cache.stager import Stager
from distcache.errors import LookaheadWindowError


@dataclass
class CacheStats:
    """Counters of one cache since it was built."""

    batches: int
    ids: int
    unique: int
    hits: int
    loads: int
    writebacks: int
    evictions: int
    critical_misses: int
    bytes_loaded: int
    bytes_written: int
    capacity: int
    num_rows: int
    staging_s: float = 0.0
    """Host time spent staging batches ahead of their lookup."""
    wait_s: float = 0.0
    """Host time lookups spent staging or waiting for rows (the critical path)."""

    @property
    def hit_rate(self) -> float:
        """Fraction of a batch's unique rows found resident when it was staged."""
        return self.hits / self.unique if self.unique else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class CacheEngine:
    """The cache of one shard.

    Args:
        num_rows: rows of the shard (all of its tables).
        dim: row width.
        config: cache settings (capacity, L, K, policy, optimizer).
        device: where the cache and its maps live.
        name: the shard, for messages.
        victim_batches: see `Scheduler`.
        capacity: cache rows (default: `config.capacity_rows(num_rows)`).
    """

    def __init__(
        self,
        *,
        num_rows: int,
        dim: int,
        config: CacheConfig,
        device: torch.device | str = "cpu",
        name: str = "cache",
        victim_batches: int = 1,
        capacity: int | None = None,
    ):
        device = torch.device(device)
        self.name = name
        self.config = config
        self.dim = dim
        self.device = device
        self.optimizer = make_optimizer(config)
        state_dim = self.optimizer.state_dim(dim)
        self.store = HostStore(num_rows, dim, state_dim, pin_memory=device.type == "cuda")
        capacity = config.capacity_rows(num_rows) if capacity is None else capacity
        self.weights = torch.zeros(capacity, dim, device=device)  # [capacity, dim]
        self.state = torch.zeros(capacity, state_dim, device=device)  # [capacity, state_dim]
        self.scheduler = Scheduler(
            num_rows,
            capacity,
            make_policy(config.policy),
            lookahead=config.lookahead,
            device=device,
            victim_batches=victim_batches,
            name=name,
        )
        self.stager = Stager(self.store, self.weights, self.state)
        self._ahead: deque[StagePlan] = deque()  # staged, not yet looked up
        self._active: deque[StagePlan] = deque()  # looked up, not yet released
        self._staging_s = 0.0
        self._wait_s = 0.0

    @property
    def capacity(self) -> int:
        return self.scheduler.capacity

    # ------------------------------------------------------------ batch flow
    def enqueue(self, ids: torch.Tensor) -> int:
        """Add a future batch's (validated) engine rows `[n]` to the look-ahead window."""
        return self.scheduler.enqueue(ids)

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
        while len(self._ahead) < depth and self.scheduler.num_unstaged:
            plan = self.scheduler.stage_next()
            self.stager.run(plan)
            self._ahead.append(plan)
            staged += 1
        if staged:
            self._staging_s += time.perf_counter() - start
        return staged

    def lookup_plan(self) -> StagePlan:
        """The next batch's plan, its rows resident: staged ahead, or staged now (critical)."""
        self.release_stale()
        start = time.perf_counter()
        if self._ahead:
            plan = self._ahead.popleft()
        elif self.scheduler.num_unstaged:
            plan = self.scheduler.stage_next(critical=True)
            self.stager.run(plan)
        else:
            raise LookaheadWindowError(f"{self.name}: lookup with no enqueued batch")
        self.stager.wait(plan)
        self._wait_s += time.perf_counter() - start
        self._active.append(plan)
        return plan

    def apply_gradients(
        self, plan: StagePlan, bag_grad: torch.Tensor, bag_of_id: torch.Tensor
    ) -> None:
        """Fused optimizer step on the batch's rows.

        Args:
            plan: the batch's staging plan (its rows are pinned).
            bag_grad: gradient of each pooled bag `[bags, dim]` (mean scaling applied).
            bag_of_id: the bag of each id `[n]`.
        """
        if plan not in self._active:
            raise LookaheadWindowError(
                f"{self.name}: backward of batch {plan.seq} ran after its rows were released "
                "(a later forward started first). distcache updates rows in backward: run "
                "backward before the next forward."
            )
        slots = plan.slots
        if self.optimizer.per_id:
            # Stateless and linear (SGD): scatter-add each id's step -lr * g, as a sparse SGD
            # step does. Scaling the few bags first is cheaper than index_add_(alpha=...).
            step = (bag_grad * -self.optimizer.lr).index_select(0, bag_of_id)  # [n, dim]
            self.weights.index_add_(0, plan.id_slots, step)
        else:
            grad = torch.zeros(slots.numel(), self.dim, device=bag_grad.device)
            grad.index_add_(0, plan.inverse, bag_grad.index_select(0, bag_of_id))  # [u, dim]
            weights = self.weights[slots]
            state = self.state[slots]
            self.optimizer.update(weights, state, grad)
            self.weights.index_copy_(0, slots, weights)
            self.state.index_copy_(0, slots, state)
        self.optimizer.step()
        self.scheduler.residency.dirty[slots] = True
        self.release(plan)

    def release(self, plan: StagePlan) -> None:
        """The batch is done: unpin its rows (without an update, e.g. in evaluation)."""
        self._active.remove(plan)
        self.scheduler.release(plan)

    def release_stale(self) -> None:
        """Release batches looked up but never backpropagated (forward without backward)."""
        while self._active:
            self.release(self._active[0])

    # ------------------------------------------------------------ state
    def flush(self) -> int:
        """Write every dirty resident row back to the host store; returns rows written."""
        res = self.scheduler.residency
        slots = res.dirty_slots()
        self.stager.write_back(slots, res.row_of[slots])
        res.dirty[slots] = False
        return slots.numel()

    def reset(self) -> None:
        """Drop every cached row and every batch in the window (after the store was reloaded).

        Dirty rows are discarded, so call `flush()` first unless the store was just overwritten.
        """
        self._ahead.clear()
        self._active.clear()
        self.scheduler.clear()

    def stats(self) -> CacheStats:
        c = self.scheduler.counters
        return CacheStats(
            batches=c.batches,
            ids=c.ids,
            unique=c.unique,
            hits=c.hits,
            loads=c.loads,
            writebacks=c.writebacks,
            evictions=c.evictions,
            critical_misses=c.critical_misses,
            bytes_loaded=self.stager.bytes_loaded,
            bytes_written=self.stager.bytes_written,
            capacity=self.capacity,
            num_rows=self.store.num_rows,
            staging_s=self._staging_s,
            wait_s=self._wait_s,
        )
