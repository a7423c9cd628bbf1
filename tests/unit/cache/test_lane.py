"""The scheduler's calls on a thread of their own (`CacheConfig.scheduler_thread`,
`distcache.cache.lane`): the same plans, updates and counters as on the training thread, bit for
bit, against the uncached reference; errors raised where they are raised inline."""

import dataclasses
import multiprocessing
import threading
import time

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache.lane import Lane
from distcache.errors import CacheCapacityError, DistcacheError, LookaheadWindowError
from tests.unit.cache.reference import (
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    train_both,
)

_SETUPS = {  # (CacheConfig settings beyond the shared ones, sequence rows)
    "torch ops": ({"fused": False}, False),
    "C kernels": ({"fused": True}, False),
    "graphs, direct": ({"cuda_graphs": True, "staging": "direct"}, False),
    "lru": ({"policy": "lru", "prefetch_depth": 0}, False),
    "rowwise adagrad": ({"optimizer": "rowwise_adagrad", "kernel": "torch"}, False),
    "sequence": ({}, True),
}


def _counts(cached) -> dict:
    """Each cache's counters and graph counts (not its times)."""
    return {
        name: dataclasses.replace(stats, staging_s=0.0, wait_s=0.0)
        for name, stats in cached.stats().items()
    }


@pytest.mark.parametrize("setup", list(_SETUPS))
def test_a_scheduler_thread_trains_as_the_training_thread_and_the_reference(setup):
    """A small cache (evictions, write-backs), L = 3 and K = 2, each setup trained with the
    scheduler's calls inline and on their thread: outputs, table weights and counters equal,
    bit for bit, and equal to uncached modules."""
    settings, sequence = _SETUPS[setup]
    tables = make_tables([4, 4, 4] if sequence else [4, 4, 3], [60, 35, 50])
    batches = make_batches(tables, batch_size=3, num_batches=25, max_len=3, seed=5)
    base = {"capacity": 24, "lookahead": 3, "prefetch_depth": 2, "learning_rate": 1.0}
    runs = []
    for threaded in (False, True):
        config = CacheConfig(**{**base, **settings}, scheduler_thread=threaded)
        runs.append(
            train_both(
                tables, config, batches, weights=integer_weights(tables, 0), sequence=sequence
            )
        )
    (inline, _, inline_pairs), (threaded, ref, threaded_pairs) = runs
    for step, ((a, ref_a), (b, _)) in enumerate(zip(inline_pairs, threaded_pairs, strict=True)):
        assert torch.equal(a, b), f"step {step}: the threaded lane's output differs"
        if settings.get("optimizer") is None:  # (Adagrad's reference rounds otherwise)
            assert torch.equal(b, ref_a), f"step {step}: differs from the uncached module"
    for t in tables:
        assert torch.equal(inline.table_weight(t.name), threaded.table_weight(t.name)), t.name
    assert _counts(inline) == _counts(threaded)
    stats = threaded.stats().values()
    assert all(s.evictions > 0 and s.writebacks > 0 for s in stats)
    if settings.get("policy") is None:
        assert all(s.critical_misses == 0 for s in stats)


def test_a_short_cache_raises_at_the_lookup_and_training_goes_on():
    """A cache too small for the batches in flight: the lane's plan says so, the lookup raises
    `CacheCapacityError` as inline, the window is dropped with nothing lost, and training goes
    on to the same rows as inline."""
    tables = make_tables([4], [50])
    batches = [
        (torch.tensor(ids), torch.tensor([0, len(ids)]))
        for ids in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10])
    ]
    outcomes = []
    for threaded in (False, True):
        config = CacheConfig(
            capacity=6, lookahead=2, prefetch_depth=2, learning_rate=1.0,
            scheduler_thread=threaded,
        )  # fmt: skip
        cached = CachedEmbeddingBags(tables, config)
        cached.load_table_weight("t0", integer_weights(tables, 0)[0])
        loss_of(cached(*batches[0])).backward()  # rows 0, 1, 2 updated and dirty
        cached.enqueue(*batches[1])
        cached.enqueue(*batches[2])
        cached.prefetch()  # [3..6] evicts a dirty row; [7..10] does not fit beside it
        loss_of(cached(*batches[1])).backward()
        with pytest.raises(CacheCapacityError, match="needs 4 more rows but only 2 of 6"):
            cached(*batches[2])
        assert cached.engines[0].scheduler.num_staged == 0  # the window was dropped
        loss_of(cached(*batches[2])).backward()  # alone in the window now: it fits
        cached.engines[0].flush()
        outcomes.append(cached.table_weight("t0"))
    assert torch.equal(*outcomes)


def _engine(threaded: bool):
    tables = make_tables([4], [100])
    config = CacheConfig(capacity=50, lookahead=2, prefetch_depth=1, scheduler_thread=threaded)
    cached = CachedEmbeddingBags(tables, config)
    return cached.engines[0]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_full_window_is_raised_by_the_enqueue_that_overflows_it(threaded):
    """A full window raises `LookaheadWindowError` from `enqueue` itself, with the lane's
    thread too (the engine's counts, not the scheduler's, which the lane may not have
    reached), and has room again once a batch is released."""
    engine = _engine(threaded)
    ids = torch.arange(4)
    for _ in range(3):  # L + 1 batches: the window is full
        engine.enqueue(ids)
    with pytest.raises(LookaheadWindowError, match="look-ahead window full: 3 batches"):
        engine.enqueue(ids)
    engine.release(engine.lookup_plan())
    engine.enqueue(ids)  # room again
    assert engine.stats().batches == 4  # (batches entered)


def test_a_failed_lane_call_stops_the_lane_and_every_later_call_says_so():
    """An error in a queued call: the calls after it do not run, and the next call of the
    engine (queueing, waiting, joining) raises a one-line `DistcacheError` naming the cache
    and the error."""
    lane = Lane(None, threaded=True, name="t0")
    ran = []

    def fail() -> None:
        raise ValueError("boom")

    lane.submit(ran.append, 1)
    lane.submit(fail)
    later = lane.submit(ran.append, 2)
    with pytest.raises(DistcacheError, match=r"^t0: the cache's scheduler thread failed.*boom"):
        lane.result(later)
    assert ran == [1]
    for call in (lambda: lane.submit(ran.append, 3), lane.join):
        with pytest.raises(DistcacheError, match="ValueError: boom"):
            call()
    assert ran == [1]
    lane.close()


def test_a_lane_runs_its_calls_in_order_on_one_other_thread():
    """Calls run in the order queued, one at a time, on a thread that is not the caller's;
    inline, each runs at once on the caller's and its error is raised there."""
    lane = Lane(None, threaded=True, name="t0")
    seen = []

    def note(k: int) -> None:
        time.sleep(0.001 * (k % 3))
        seen.append((k, threading.get_ident()))

    for k in range(20):
        lane.submit(note, k)
    lane.join()
    assert [k for k, _ in seen] == list(range(20))
    (ident,) = {ident for _, ident in seen}
    assert ident != threading.get_ident()
    lane.close()
    inline = Lane(None, threaded=False, name="t0")
    assert inline.submit(lambda: threading.get_ident()) == threading.get_ident()
    assert inline.result(inline.submit(lambda: 7)) == 7
    with pytest.raises(ZeroDivisionError):
        inline.submit(lambda: 1 / 0)


def _in_child(lane: Lane, queue) -> None:  # noqa: ANN001
    ran = []
    lane.submit(ran.append, 1)
    lane.join()
    queue.put(ran)


def test_a_forked_child_gets_a_lane_thread_of_its_own():
    """A process forked after its parent's lane started a thread (a rank forked from a built
    model) runs its calls on a thread of its own, instead of queueing them for the parent's,
    which is not in the child."""
    lane = Lane(None, threaded=True, name="t0")
    lane.submit(int)
    lane.join()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(lane, queue))
    child.start()
    try:
        assert queue.get(timeout=30) == [1]
    finally:
        child.join(timeout=10)
        child.kill()
    assert child.exitcode == 0
    lane.close()
