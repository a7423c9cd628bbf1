"""`StagePlan`: what staging one batch does, as the scheduler plans it (`Scheduler.stage_next`),
the stager executes it (`Stager.submit`) and the lookup and the update read it (the batch's
ids remapped to slots). Its counts stay on the device until the stager mirrors them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distcache.cache.window import WindowBatch

# Entries of `StagePlan.counts` (int64, on the device until the stager mirrors them). FREE:
# the slots never loaded, after the plan; once the host sees 0 (`note_counts`, at a batch's
# lookup) the cache is full until `clear()`, and `Victims` offers no free slots.
UNIQUE, MISSES, LOADS, WRITEBACKS, EVICTIONS, CANDIDATES, FREE = range(7)
NUM_COUNTS = 7


@dataclass(eq=False)
class StagePlan:
    """What staging one batch does: the transfers, and the batch's ids remapped to slots.

    It covers the first m of the batch's packed rows (`Scheduler._stage_size`: its distinct
    rows, or all n of them). Transfers are packed at the front of `size`-entry buffers
    (`size = min(m, capacity)`); their counts are `counts[LOADS]` and `counts[WRITEBACKS]`, on
    the device. The stager must write `writeback_*` back before it loads `load_*` (a victim's
    slot may be reused by a row loaded in the same plan).
    """

    seq: int
    batch: WindowBatch  # the batch's distinct rows and inverse
    slots: torch.Tensor  # [m] int64 slot of each of the first m `batch.rows` (`_stage_size`)
    id_slots: torch.Tensor  # [n] int64 slot of every id, in input order
    load_rows: torch.Tensor  # [size] int64 rows to bring in (first counts[LOADS])
    load_slots: torch.Tensor  # [size] int64 their slots
    writeback_rows: torch.Tensor  # [size] int64 dirty victims to write out (first counts[WB])
    writeback_slots: torch.Tensor  # [size] int64 their slots (before the loads overwrite them)
    counts: torch.Tensor  # [NUM_COUNTS] int64 on the device
    critical: bool  # staged when the batch was looked up: its loads stall training
    pinned_batches: int  # batches in flight when it was staged (for error messages)
    moves: bool = True  # False: a cache of every row's plan, which loads and writes back nothing
    host_counts: list[int] | None = None  # `counts` on the host, once looked up (engine)
    host_check: list[int] | None = None  # the caller's check words, once looked up (engine)

    @property
    def inverse(self) -> torch.Tensor:
        """`[n]` index in `batch.rows` of each id's row (as `unique(return_inverse=True)`)."""
        return self.batch.inv[: self.batch.num_ids]
