"""DESIGN invariants 1-4 and 6 on CUDA, where rows move on the stager's side stream.

The same checks as `tests/unit/cache/test_invariants.py`, on a cache in device memory, with
rows also staged ahead while a batch trains (its loads then run concurrently with compute).
"""

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from tests.gpu.common import CUDA_REASON, loss_on_device, to_device
from tests.unit.cache.reference import (
    ReferenceBags,
    integer_weights,
    make_batches,
    make_tables,
    reference_optimizer,
)
from tests.unit.cache.test_invariants import StoreSpy

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)
ROWS = 40


def _settle() -> None:
    """Wait for every stream (the stager's too) before reading the cache from the host."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _setup(capacity: int = 10, depth: int = 1):
    tables = make_tables([4], [ROWS])
    weights = integer_weights(tables, 0)
    config = CacheConfig(capacity=capacity, lookahead=3, prefetch_depth=depth, learning_rate=1.0)
    cached = CachedEmbeddingBags(tables, config, device=DEVICE)
    cached.load_table_weight("t0", weights[0])
    ref = ReferenceBags(tables, weights)
    return tables, config, cached, ref, reference_optimizer(config, ref.parameters())


def _reference_step(ref, opt, batch) -> torch.Tensor:
    out = ref(*batch)
    opt.zero_grad()
    loss_on_device(out).backward()
    opt.step()
    return out.detach()


@pytest.mark.parametrize("depth", [1, 2])
def test_one_authoritative_copy_and_no_lost_update_while_staging_ahead(depth):
    """Invariants 1-2: with rows staged up to `depth` batches ahead, also while a batch trains,
    every resident row's slot holds its latest value and the host store every other row's."""
    tables, config, cached, ref, opt = _setup(capacity=12, depth=depth)
    (engine,) = cached.engines
    batches = make_batches(tables, batch_size=3, num_batches=30, max_len=3, seed=1)
    res = engine.scheduler.residency
    enqueued = 0
    for t, batch in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + config.lookahead:
            cached.enqueue(*to_device(batches[enqueued], DEVICE))
            enqueued += 1
        cached.prefetch()
        out = cached(*to_device(batch, DEVICE))
        cached.prefetch()  # the next rows move while this batch trains
        loss_on_device(out).backward()
        expected_out = _reference_step(ref, opt, batch)
        _settle()
        assert torch.equal(out.detach().cpu(), expected_out), f"step {t}"
        expected = ref.bags[0].weight.data
        resident = (res.row_of >= 0).cpu()
        rows = res.row_of.cpu()[resident]
        slots = resident.nonzero().squeeze(1)
        assert torch.equal(engine.weights.cpu()[slots], expected[rows]), f"step {t}"
        others = torch.ones(ROWS, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(engine.store.weights[others], expected[others]), f"step {t}"
    stats = engine.stats()
    assert stats.writebacks > 0 and stats.critical_misses == 0


def test_clean_rows_never_written_back_and_writes_precede_loads():
    """Invariants 3-4 in the order the host store sees them: a write-back only for a row
    updated since it was loaded, and a row is loaded again only after its write-back."""
    tables, config, cached, ref, _ = _setup(capacity=8)
    (engine,) = cached.engines
    spy = StoreSpy(engine)
    batches = make_batches(tables, batch_size=2, num_batches=40, max_len=3, seed=2)
    updated = set()  # rows updated since they were last loaded
    original_run = engine.stager.run

    def checked_run(plan):
        start = len(spy.log)
        original_run(plan)
        ops = [op for op, _ in spy.log[start:]]
        assert ops == sorted(ops, key=lambda op: op != "write"), "write-backs before loads"

    engine.stager.run = checked_run
    for t, batch in enumerate(batches):
        train = t % 3 != 0  # every third batch is only read (eval): its rows stay clean
        cached.train(train)
        out = cached(*to_device(batch, DEVICE))  # stages the batch: write-backs, loads logged
        for op, rows in spy.log:
            for r in rows:
                if op == "write":
                    assert r in updated, f"row {r} written back although clean"
                    updated.discard(r)
                else:
                    assert r not in updated, f"row {r} reloaded before its write-back"
        spy.log.clear()
        if train:
            loss_on_device(out).backward()
            updated.update(torch.unique(batch[0]).tolist())
    stats = engine.stats()
    assert stats.writebacks > 0 and stats.evictions > stats.writebacks


def test_flush_then_store_equals_reference_and_second_flush_writes_nothing():
    tables, config, cached, ref, opt = _setup(capacity=12)
    (engine,) = cached.engines
    for batch in make_batches(tables, batch_size=3, num_batches=15, max_len=3, seed=3):
        loss_on_device(cached(*to_device(batch, DEVICE))).backward()
        _reference_step(ref, opt, batch)
    assert engine.flush() > 0
    assert not bool(engine.scheduler.residency.dirty.any())
    assert torch.equal(engine.store.weights, ref.bags[0].weight.data)
    assert engine.flush() == 0


def test_state_dict_flushes_and_round_trips():
    """Invariant 6: `state_dict()` holds every update, also those only in the device cache."""
    tables, config, cached, ref, opt = _setup(capacity=12)
    batches = make_batches(tables, batch_size=3, num_batches=20, max_len=3, seed=4)
    for batch in batches[:10]:
        loss_on_device(cached(*to_device(batch, DEVICE))).backward()
        _reference_step(ref, opt, batch)
    state = cached.state_dict()  # no explicit flush
    assert state["t0.weight"].device.type == "cpu"
    assert torch.equal(state["t0.weight"], ref.bags[0].weight.data)
    fresh = CachedEmbeddingBags(tables, config, seed=99, device=DEVICE)
    fresh.load_state_dict(state)
    for batch in batches[10:]:
        loss_on_device(fresh(*to_device(batch, DEVICE))).backward()
        _reference_step(ref, opt, batch)
    assert torch.equal(fresh.table_weight("t0"), ref.bags[0].weight.data)


def test_load_clears_cached_rows():
    tables, config, cached, _, _ = _setup(capacity=12)
    batch = to_device(
        make_batches(tables, batch_size=3, num_batches=1, max_len=3, seed=5)[0], DEVICE
    )
    cached.eval()
    cached(*batch)
    (engine,) = cached.engines
    assert engine.scheduler.residency.num_resident() > 0
    cached.load_table_weight("t0", torch.zeros(ROWS, 4))
    assert engine.scheduler.residency.num_resident() == 0
    assert torch.equal(cached(*batch).cpu(), torch.zeros(3, 4))  # no stale cached row is served
