"""The scheduler's device work is the same for every batch of a size: what a CUDA graph replays.

A captured CUDA graph replays the kernels it recorded with the arguments it recorded; only what
they read from memory changes. So the scheduler can be captured once per batch size only if
its ops, and every host value they take (a Python number, a shape), do not change from batch
to batch: the seq and the window's positions must reach the device as tensors. `OpRecorder`
records both for two batches of one size in steady state (the cache full, evicting, writing
dirty rows back) and they must be equal. A plan covers the batch's distinct rows, padded to a
few sizes when graphs are on (`Scheduler._stage_size`): two plans of one such size.
"""

from __future__ import annotations

import pytest
import torch

import distcache.cache.scheduler as scheduler_module
from distcache.cache.plan import EVICTIONS, WRITEBACKS
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.cache.window import _PAD_FROM
from tests.device_audit import OpRecorder


def _steady_scheduler(policy: str, n: int, rows: int, capacity: int, lookahead: int = 8):
    """A scheduler past its warm-up, and a function that enqueues the next batch and stages
    (then releases) the oldest, recording the device work of each (what `cuda_graphs`
    captures: the functions the scheduler runs through its `GraphCache`) into the recorders
    it is given."""
    scheduler = Scheduler(rows, capacity, make_policy(policy), lookahead=lookahead)
    g = torch.Generator().manual_seed(0)
    # Power-law ids with some invalid ones (the sentinel row), as a routed batch has.
    weights = 1.0 / torch.arange(1, rows + 2, dtype=torch.float64)
    recorders: dict[str, OpRecorder] = {}

    def run(key, fn, *inputs, capture=True):  # noqa: ANN001, ANN002, ANN202
        recorder = recorders.pop(key[0], None)
        if recorder is None:
            return fn(*inputs)
        with recorder:
            return fn(*inputs)

    scheduler.graphs.run = run
    scheduler.graphs.enabled = True  # plans cover a few sizes of distinct rows (`_stage_size`)

    def batch() -> torch.Tensor:
        return torch.multinomial(weights, n, replacement=True, generator=g)

    for _ in range(lookahead):
        scheduler.enqueue(batch())

    def step(enqueue: OpRecorder | None = None, stage: OpRecorder | None = None):
        recorders.update({"enqueue": enqueue, "stage": stage} if enqueue else {})
        scheduler.enqueue(batch())
        plan = scheduler.stage_next()
        assert not recorders  # both ran through `graphs.run`
        scheduler.release(plan)
        return plan

    for _ in range(40):
        step()
    return scheduler, step


def _two_of_a_size(step) -> tuple[list, list[tuple[OpRecorder, OpRecorder]]]:  # noqa: ANN001
    """Steps recorded until two plans cover the same number of rows (`_stage_size`: the
    batch's distinct rows, padded to a few sizes): those two plans and their records."""
    seen: dict[int, tuple] = {}
    for _ in range(30):
        enqueue, stage = OpRecorder(), OpRecorder()
        plan = step(enqueue, stage)
        size = plan.slots.numel()
        if size in seen:
            first_plan, first_record = seen[size]
            return [first_plan, plan], [first_record, (enqueue, stage)]
        seen[size] = (plan, (enqueue, stage))
    raise AssertionError(f"no two plans of one size in 30 steps: {sorted(seen)}")


@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
@pytest.mark.parametrize("n", [256, _PAD_FROM + 100])  # sorted as is / padded to a radix sort
def test_every_batch_of_a_size_dispatches_the_same_ops(policy, n):
    _, step = _steady_scheduler(policy, n, rows=8 * n, capacity=3 * n)
    plans, records = _two_of_a_size(step)
    assert plans[0].slots.numel() < n  # its distinct rows, not its ids
    for plan in plans:  # steady state: evicting dirty rows
        assert plan.counts[EVICTIONS] > 0 and plan.counts[WRITEBACKS] > 0
    (enqueue_a, stage_a), (enqueue_b, stage_b) = records
    assert len(enqueue_a.ops) > 20 and len(stage_a.ops) > 50
    assert enqueue_a.ops == enqueue_b.ops, enqueue_a.diff(enqueue_b)
    assert stage_a.ops == stage_b.ops, stage_a.diff(stage_b)


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
def test_sampled_victims_dispatch_the_same_ops(policy, monkeypatch):
    """With a cache larger than the victims' sweep (`Victims`: free slots, sweep), every
    batch of a size still dispatches the same ops."""
    monkeypatch.setattr(scheduler_module, "MIN_SCAN", 1)
    n = 256
    scheduler, step = _steady_scheduler(policy, n, rows=16 * n, capacity=6 * n)
    assert scheduler._scan(n) < scheduler.capacity
    plans, records = _two_of_a_size(step)
    for plan in plans:
        assert plan.counts[EVICTIONS] > 0 and plan.counts[WRITEBACKS] > 0
    (enqueue_a, stage_a), (enqueue_b, stage_b) = records
    assert enqueue_a.ops == enqueue_b.ops, enqueue_a.diff(enqueue_b)
    assert stage_a.ops == stage_b.ops, stage_a.diff(stage_b)


def test_the_recorder_sees_a_python_number_that_changes():
    x = torch.zeros(4, dtype=torch.int32)
    records = []
    for seq in (3, 4):
        on_device = torch.full((), seq, dtype=torch.int32)
        record = OpRecorder()
        with record:
            x.add_(seq)  # a host value baked into the op
            x.add_(on_device)  # a tensor: read from memory
            x.add_(torch.tensor(seq))  # a tensor made of host data in the work: baked too
        records.append(record)
    first, second = records
    assert first.ops[0] != second.ops[0] and first.ops[1] == second.ops[1]
    assert first.ops[2:] != second.ops[2:]
    assert "add_" in first.diff(second)
