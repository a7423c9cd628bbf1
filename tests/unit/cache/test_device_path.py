"""The per-batch path never reads the device back (DESIGN.md, "The device path").

The path (route and enqueue a future batch, stage K ahead, look the training batch up, backward
with the fused optimizer, release) runs under `SyncAudit` in steady state: the cache full,
evicting, writing dirty rows back. The stager's worker thread (CUDA's; on CPU plans run when
submitted, and a variant runs the thread) is audited too, and so is direct staging (its copies
are queued by the training thread). The scheduler also runs under `FakeTensorMode` on a (fake)
CUDA device, which refuses any data-dependent op.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from distcache import CacheConfig, CachedEmbeddingBags, CachedEmbeddings
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.cache.streams import HostCopy
from tests.device_audit import SyncAudit
from tests.unit.cache.reference import loss_of, make_batches, make_tables

TABLES = make_tables([8, 8, 4], [4000, 3000, 2000], ["sum", "mean", "sum"])


@pytest.mark.parametrize(
    ("policy", "optimizer", "depth", "variant", "kernel"),
    [
        ("lookahead", "sgd", 1, "plain", "fbgemm"),
        ("lookahead", "sgd", 1, "plain", "torch"),
        ("lookahead", "sgd", 1, "threaded", "fbgemm"),  # the stager's worker thread, as on CUDA
        ("lookahead", "adam", 3, "plain", "torch"),
        ("lru", "rowwise_adagrad", 0, "plain", "fbgemm"),
        ("lookahead", "adagrad", 1, "plain", "fbgemm"),
        ("lookahead", "sgd", 1, "weighted fp16", "fbgemm"),  # per-id weights, half rows
        ("lookahead", "rowwise_adagrad", 1, "weighted fp16", "torch"),
        ("lookahead", "rowwise_adagrad", 1, "sequence", "fbgemm"),  # per-id rows (EC)
        ("lookahead", "sgd", 1, "sequence", "torch"),
        # staging="direct": copies bounded on the device
        ("lookahead", "adam", 2, "direct", "torch"),
        ("lru", "sgd", 0, "direct", "fbgemm"),
        # the CPU's default: the fused passes' C kernels (what torch ops remain around them)
        ("lookahead", "sgd", 1, "c kernels", "torch"),
    ],
)
def test_steady_state_path_has_no_read_back(policy, optimizer, depth, variant, kernel):
    """With either kernel (`CacheConfig.kernel`; FBGEMM's reads only its host counters), and
    the scheduler's torch ops (`fused=False`: what CUDA runs by default) but in one variant."""
    lookahead = 8
    half = variant == "weighted fp16"
    tables = [dataclasses.replace(t, dtype=torch.float16) for t in TABLES] if half else TABLES
    module = CachedEmbeddingBags
    if variant == "sequence":  # one width, as EmbeddingCollection requires
        tables, module = make_tables([8, 8], [4000, 3000], ["sum", "sum"]), CachedEmbeddings
    config = CacheConfig(
        capacity=70,  # rows per table
        lookahead=lookahead,
        prefetch_depth=depth,
        policy=policy,
        optimizer=optimizer,
        learning_rate=0.1,
        staging="direct" if variant == "direct" else "worker",
        kernel=kernel,
        fused=None if variant == "c kernels" else False,
        # half rows rounded stochastically, as on CUDA (FBGEMM's CPU kernels cannot)
        stochastic_rounding=True if half and kernel == "torch" else None,
    )
    cached = module(tables, config)
    assert all(e.kernel == kernel for e in cached.engines)
    batches = make_batches(tables, batch_size=8, num_batches=60, max_len=2, seed=0)
    id_weights = [torch.rand(values.numel()) if half else None for values, _ in batches]
    audit = SyncAudit(t for e in cached.engines if e.tbe is not None for t in e.tbe.host_tensors)
    for engine in cached.engines:
        engine.stager.threaded = variant == "threaded"
        engine.stager._execute = audit.wrap(engine.stager._execute)
    enqueued = 0
    for t, batch in enumerate(batches):
        if t == 30:  # warm: caches full; from here on the whole path is audited
            stats = cached.stats()
            assert all(s.evictions > 0 and s.writebacks > 0 for s in stats.values()), stats
            audit.sites.clear()
            audit.__enter__()
        while enqueued < len(batches) and enqueued <= t + lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        out = cached(*batch, id_weights[t]) if half else cached(*batch)
        cached.prefetch()  # stage ahead while this batch trains
        loss_of(out).backward()
    audit.__exit__(None, None, None)
    assert not audit.sites, f"device read-backs in the per-batch path: {audit.report()}"
    stats = cached.stats()  # reading the counters is a read-back, outside the path
    assert sum(s.loads for s in stats.values()) > 0
    if policy == "lookahead":
        assert all(s.critical_misses == 0 for s in stats.values())


def test_the_audit_catches_read_backs():
    x = torch.arange(10)
    audit = SyncAudit()
    with audit:
        int(x.sum())
        x[x > 3]
        x.nonzero()
        torch.unique(x)
        torch.repeat_interleave(x, x)
        x.clone().index_fill_(0, torch.tensor([1]), torch.tensor(7))  # a tensor value: .item()
        x[torch.tensor([1, 2])]  # integer indexing: fine
        x.clone().index_fill_(0, torch.tensor([1]), 7)  # a Python value: fine
        torch.repeat_interleave(x, x, output_size=45)  # sized: fine
    names = sorted(s.split(": ")[-1] for s in audit.sites)
    assert names == [
        "aten::_local_scalar_dense",
        "aten::_unique2",
        "aten::index",
        "aten::index_fill_",
        "aten::nonzero",
        "aten::repeat_interleave",
    ], audit.report()


@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
def test_scheduler_runs_on_fake_tensors(policy, monkeypatch):
    """Under FakeTensorMode a tensor has no data: any op that needs its values on the host
    raises, `.tolist()` and `.numpy()` included. The scheduler enqueues, stages (evicting: the
    cache is smaller than the batches) and releases without one, but for the one host read it
    makes by design: a batch's distinct count, copied to the host when it entered the window
    and read when it is staged after a later batch entered (`Scheduler._stage_size`), stood in
    for here (a fake tensor has no value to copy)."""
    read = []
    monkeypatch.setattr(HostCopy, "read_if_done", lambda self: read.append(1) or [25])
    with FakeTensorMode():
        s = Scheduler(500, 40, make_policy(policy), lookahead=4)
        plans = []
        for _ in range(3):
            s.enqueue(torch.randint(0, 500, (30,)))
        for _ in range(12):
            s.enqueue(torch.randint(0, 500, (30,)))
            plans.append(s.stage_next())
            if len(plans) > 1:
                s.release(plans.pop(0))
            assert plans[-1].id_slots.shape == (30,)
            assert plans[-1].slots.shape == (25,)  # its distinct rows
        s.release(plans.pop(0))
        while s.num_unstaged > 1:
            s.release(s.stage_next())
        assert s.stage_next().slots.shape == (30,)  # the newest batch: every row, no read
    assert len(read) == 14
    with pytest.raises(Exception, match="_local_scalar_dense"), FakeTensorMode():
        _ = Scheduler(500, 40, make_policy(policy), lookahead=4).counters  # a read: caught


def test_a_count_still_on_its_way_is_not_waited_for(monkeypatch):
    """Where a batch's distinct count has not reached the host when it is staged (the device
    runs behind), its plan covers all of its rows and is not captured into a graph (a capture
    synchronizes): same plans, as training without the count shows."""
    batches = [
        torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(i)) for i in range(16)
    ]

    def plans(scheduler: Scheduler) -> list[list[int]]:
        out, staged = [], []
        for b in batches[:3]:
            scheduler.enqueue(b)
        for b in batches[3:]:
            scheduler.enqueue(b)
            staged.append(scheduler.stage_next())
            out.append(staged[-1].id_slots.tolist())
            if len(staged) > 1:
                scheduler.release(staged.pop(0))
        return out

    def scheduler() -> Scheduler:
        s = Scheduler(500, 40, make_policy("lookahead"), lookahead=4)
        s.graphs.enabled = True
        return s

    known = scheduler()
    expected = plans(known)
    assert known.graphs.captures > 0
    monkeypatch.setattr(HostCopy, "read_if_done", lambda self: None)
    behind = scheduler()
    assert plans(behind) == expected
    staged = [k for k in behind.graphs._entries if k[0] == "stage"]
    assert staged == [], "a plan of unknown size was captured"
