"""The stager on CPU: plans run when submitted (the worker thread is CUDA's); host rows reused.

Correctness of what it moves (write-backs before loads, nothing lost) is checked against
uncached references in `test_invariants.py` and `test_module.py`.
"""

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache.streams import DeviceInts
from tests.unit.cache.reference import make_batches, make_tables


def _train(cached, batches, lookahead):
    """Drive `cached` as the pipeline does: L batches enqueued ahead, K staged, forward and
    backward, each step ending when the worker is idle."""
    enqueued = 0
    for t, batch in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        cached(*batch).sum().backward()
        for engine in cached.engines:
            engine.stager.drain()
        yield t


def _cached(capacity=12, fused=None):
    tables = make_tables([4], [200])
    config = CacheConfig(
        capacity=capacity, lookahead=3, prefetch_depth=1, learning_rate=0.1, fused=fused
    )
    cached = CachedEmbeddingBags(tables, config)
    batches = make_batches(tables, batch_size=4, num_batches=30, max_len=3, seed=3)
    return cached, batches, config


def test_plans_run_when_submitted_on_cpu():
    cached, batches, config = _cached()
    (engine,) = cached.engines
    assert not engine.stager.threaded
    for _ in _train(cached, batches, config.lookahead):
        pass
    assert engine.stats().loads > 0 and engine.stager._executor is None  # no thread started


def test_staging_reuses_its_host_rows_and_grows_them_when_a_plan_moves_more():
    """(torch's copies, through host rows: the CUDA worker's; the C kernels copy row to row)"""
    cached, batches, config = _cached(capacity=12, fused=False)
    (engine,) = cached.engines
    stager = engine.stager
    assert stager._rows is None
    buffers, moved = [None], []  # the buffer after each step (kept alive: no id is reused)
    loads = 0
    for _ in _train(cached, batches, config.lookahead):
        stats = engine.stats()
        moved.append(stats.loads - loads)
        loads = stats.loads
        buffers.append(None if stager._rows is None else stager._rows[0])
    assert stager._rows[0].shape[0] >= max(moved)
    # A new buffer only when a plan moved more rows than the buffer held (growth doubles).
    new = sum(1 for a, b in zip(buffers, buffers[1:], strict=False) if a is not b)
    assert 1 <= new <= 1 + max(moved).bit_length()
    assert all(b is buffers[-1] for b in buffers[-10:])


def test_device_ints_are_built_once_per_value():
    """Host ints for the device are built once per value (on CUDA, building one waits for
    the device), and the kept ones are bounded."""
    ints = DeviceInts(limit=2)
    cpu = torch.device("cpu")
    first = ints([3, 1, 2], cpu)
    assert first.tolist() == [3, 1, 2] and first.dtype == torch.int64
    assert ints((3, 1, 2), cpu) is first  # the same value: the same tensor
    second = ints([4], cpu)
    assert second is not first and ints([4], cpu) is second
    ints([5], cpu)  # a third value: the kept ones are dropped, this one kept
    assert ints([3, 1, 2], cpu) is not first


@pytest.mark.parametrize("staging", ["worker", "direct"])
def test_a_dropped_window_leaves_no_staged_plan_behind(staging):
    """After an error the window is dropped: the plans staged for it are done and forgotten
    (their rows counted), not kept until a later plan of the same number replaces them."""
    tables = make_tables([4], [200])
    config = CacheConfig(capacity=40, lookahead=3, prefetch_depth=2, staging=staging)
    cached = CachedEmbeddingBags(tables, config)
    batches = make_batches(tables, batch_size=4, num_batches=4, max_len=3, seed=3)
    (engine,) = cached.engines
    for batch in batches:
        cached.enqueue(*batch)
    cached.prefetch()  # two plans staged, neither looked up
    assert len(engine.stager._jobs) == 2
    engine.drop_window()
    assert not engine.stager._jobs
    assert engine.store.rows_read == engine.stats().loads > 0
