"""DESIGN invariants 1-4 and 6, checked on the host store and cache while training.

Tests taking `device` run here on the CPU and, imported by `tests/gpu/test_invariants_cuda.py`
with its own `device` fixture, on CUDA.
"""

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from tests.unit.cache.reference import (
    ReferenceBags,
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    reference_optimizer,
)


class StoreSpy:
    """Logs every host-store read and write of an engine, in order."""

    def __init__(self, engine):
        self.log: list[tuple[str, list[int]]] = []
        store = engine.store
        gather, scatter = store.gather, store.scatter

        def spy_gather(rows, out=None):
            self.log.append(("load", rows.tolist()))
            return gather(rows, out)

        def spy_scatter(rows, weights, state):
            self.log.append(("write", rows.tolist()))
            scatter(rows, weights, state)

        store.gather, store.scatter = spy_gather, spy_scatter


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu")


def _on(batch, device):
    values, offsets = batch
    return values.to(device), offsets.to(device)


def _setup(capacity=10, depth=1, device="cpu", staging="worker", threaded=None):
    """`threaded`: the stager's worker thread (the default on CUDA) or not (on CPU)."""
    tables = make_tables([4], [40])
    weights = integer_weights(tables, 0)
    config = CacheConfig(
        capacity=capacity, lookahead=3, prefetch_depth=depth, learning_rate=1.0, staging=staging
    )
    cached = CachedEmbeddingBags(tables, config, device=device)
    if threaded is not None:
        for engine in cached.engines:
            engine.stager.threaded = threaded
    cached.load_table_weight("t0", weights[0])
    ref = ReferenceBags(tables, weights)
    return tables, config, cached, ref, reference_optimizer(config, ref.parameters())


@pytest.mark.parametrize(
    ("staging", "threaded"), [("worker", None), ("worker", True), ("direct", None)]
)
def test_one_authoritative_copy_and_no_lost_update_without_flush(staging, threaded):
    tables, config, cached, ref, opt = _setup(staging=staging, threaded=threaded)
    (engine,) = cached.engines
    batches = make_batches(tables, batch_size=3, num_batches=30, max_len=3, seed=1)
    res = engine.scheduler.residency
    enqueued = 0
    for t, batch in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + config.lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        loss_of(cached(*batch)).backward()
        opt.zero_grad()
        loss_of(ref(*batch)).backward()
        opt.step()
        expected = ref.bags[0].weight.data
        engine.stager.drain()  # staged-ahead transfers complete (the worker thread's)
        slots = res.resident_slots()
        rows = res.row_of[slots]
        # Resident rows: the cache slot is authoritative (invariant 2).
        assert torch.equal(engine.weights[slots], expected[rows])
        # Every other row: the host store holds the latest value, evicted dirty rows included.
        others = torch.ones(40, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(engine.store.weights[others], expected[others]), f"step {t}"
    assert engine.stats().writebacks > 0


def test_clean_rows_never_written_back_and_writes_precede_loads(device):
    """Invariants 3-4 in the order the host store sees them: a write-back only for a row
    updated since it was loaded, and a row is loaded again only after its write-back."""
    tables, config, cached, ref, _ = _setup(capacity=8, device=device)
    (engine,) = cached.engines
    spy = StoreSpy(engine)
    batches = make_batches(tables, batch_size=2, num_batches=40, max_len=3, seed=2)
    updated = set()  # rows updated since they were last loaded
    original_execute = engine.stager._execute

    def checked_execute(job):  # one plan at a time (on CUDA, on the stager's worker thread)
        start = len(spy.log)
        original_execute(job)
        ops = [op for op, _ in spy.log[start:]]
        assert ops == sorted(ops, key=lambda op: op != "write"), "write-backs before loads"

    engine.stager._execute = checked_execute
    for t, batch in enumerate(batches):
        train = t % 3 != 0  # every third batch is only read (eval): its rows stay clean
        cached.train(train)
        out = cached(*_on(batch, device))  # stages the batch: write-backs and loads are logged
        for op, rows in spy.log:
            for r in rows:
                if op == "write":
                    assert r in updated, f"row {r} written back although clean"
                    updated.discard(r)
                else:
                    assert r not in updated, f"row {r} reloaded before its write-back"
        spy.log.clear()
        if train:
            loss_of(out).backward()
            updated.update(torch.unique(batch[0]).tolist())
    assert engine.stats().writebacks > 0 and engine.stats().evictions > engine.stats().writebacks


def test_flush_then_store_equals_reference_and_second_flush_writes_nothing(device):
    tables, config, cached, ref, opt = _setup(capacity=12, device=device)
    (engine,) = cached.engines
    for batch in make_batches(tables, batch_size=3, num_batches=15, max_len=3, seed=3):
        loss_of(cached(*_on(batch, device))).backward()
        opt.zero_grad()
        loss_of(ref(*batch)).backward()
        opt.step()
    assert engine.flush() > 0
    assert engine.scheduler.residency.dirty_slots().numel() == 0
    assert torch.equal(engine.store.weights, ref.bags[0].weight.data)
    assert engine.flush() == 0


@pytest.mark.parametrize("capacity", [12, 40])  # 40: a cache of every row, loaded up front
def test_state_dict_flushes_and_round_trips(device, capacity):
    """Invariant 6: `state_dict()` holds every update, also those only in the cache."""
    tables, config, cached, ref, opt = _setup(capacity=capacity, device=device)
    batches = make_batches(tables, batch_size=3, num_batches=20, max_len=3, seed=4)
    for batch in batches[:10]:
        loss_of(cached(*_on(batch, device))).backward()
        opt.zero_grad()
        loss_of(ref(*batch)).backward()
        opt.step()
    state = cached.state_dict()  # no explicit flush (invariant 6)
    assert state["t0.weight"].device.type == "cpu"  # the host store, whatever the device
    assert torch.equal(state["t0.weight"], ref.bags[0].weight.data)
    fresh = CachedEmbeddingBags(tables, config, seed=99, device=device)
    fresh.load_state_dict(state)
    for batch in batches[10:]:
        loss_of(fresh(*_on(batch, device))).backward()
        opt.zero_grad()
        loss_of(ref(*batch)).backward()
        opt.step()
    assert torch.equal(fresh.table_weight("t0"), ref.bags[0].weight.data)


def test_a_cache_of_every_row_loads_its_rows_again_after_a_load(device):
    """A cache of every row loads all of them before its first batch (`Stager.load_all`), and
    again after its rows are overwritten mid-training: the next batches train on the new rows,
    as the reference does."""
    tables, config, cached, ref, opt = _setup(capacity=40, device=device)
    batches = make_batches(tables, batch_size=3, num_batches=10, max_len=3, seed=6)

    def train(some):
        for batch in some:
            loss_of(cached(*_on(batch, device))).backward()
            opt.zero_grad()
            loss_of(ref(*batch)).backward()
            opt.step()

    train(batches[:5])
    (engine,) = cached.engines
    assert engine.scheduler.residency.num_resident() == 40 and engine.stats().loads == 0
    new = integer_weights(tables, 7)[0]
    cached.load_table_weight("t0", new)
    with torch.no_grad():
        ref.bags[0].weight.copy_(new)
    train(batches[5:])
    assert torch.equal(cached.table_weight("t0"), ref.bags[0].weight.data)


@pytest.mark.parametrize("capacity", [12, 40])  # 40: a cache of every row, loaded up front
def test_load_clears_cached_rows(device, capacity):
    tables, config, cached, _, _ = _setup(capacity=capacity, device=device)
    batch = _on(make_batches(tables, batch_size=3, num_batches=1, max_len=3, seed=5)[0], device)
    cached.eval()
    cached(*batch)
    (engine,) = cached.engines
    assert engine.scheduler.residency.num_resident() > 0
    zeros = torch.zeros(40, 4)
    cached.load_table_weight("t0", zeros)
    assert engine.scheduler.residency.num_resident() == 0
    assert torch.equal(cached(*batch).cpu(), torch.zeros(3, 4))  # no stale cached row is served
