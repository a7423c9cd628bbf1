"""The look-ahead scheduler: residency bookkeeping, pins, eviction order, window errors."""

import pytest
import torch

from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.errors import CacheCapacityError, LookaheadWindowError


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64)


def _check_bijection(s: Scheduler):
    res = s.residency
    resident = (res.row_of >= 0).nonzero().squeeze(1)
    assert torch.equal(res.slot_of[res.row_of[resident]], resident)
    assert int((res.slot_of >= 0).sum()) == resident.numel() <= s.capacity


def test_lookahead_evicts_row_with_farthest_next_use():
    s = Scheduler(10, 3, make_policy("lookahead"), lookahead=4)
    for batch in ([0, 1, 2], [3], [0], [1], [2]):
        s.enqueue(_ids(*batch))
    s.release(s.stage_next())
    plan = s.stage_next()  # batch [3]: rows 0, 1, 2 are next used at 2, 3, 4: evict 2
    assert plan.load_rows.tolist() == [3]
    assert plan.writeback_rows.numel() == 0  # nothing was updated (dirty)
    assert s.residency.slot_of[2] == -1
    s.release(plan)
    for _ in range(2):
        p = s.stage_next()
        assert p.load_rows.numel() == 0  # 0 and 1 hit
        s.release(p)
    _check_bijection(s)


def test_lookahead_prefers_rows_outside_window_then_lowest_count():
    s = Scheduler(10, 3, make_policy("lookahead"), lookahead=3)
    for batch in ([0, 1], [0, 2], [5], [0]):
        s.enqueue(_ids(*batch))
    s.release(s.stage_next())
    s.release(s.stage_next())
    plan = s.stage_next()  # [5]: 0 is used next; 1 and 2 not; 1 and 2 both seen once: one of them
    assert plan.load_rows.tolist() == [5]
    assert s.residency.slot_of[0] >= 0


def test_pinned_rows_are_never_evicted():
    s = Scheduler(50, 7, make_policy("lru"), lookahead=3)
    for batch in ([0, 1, 2], [3, 4], [5, 6], [7, 8, 9]):
        s.enqueue(_ids(*batch))
    first, second, third = s.stage_next(), s.stage_next(), s.stage_next()
    s.release(first)  # only the first batch's slots may be reused
    fourth = s.stage_next()
    assert sorted(fourth.load_slots.tolist()) == sorted(first.slots.tolist())
    for plan in (second, third):
        assert torch.equal(s.residency.slot_of[plan.rows], plan.slots)


def test_capacity_error_changes_nothing_and_names_the_sizes():
    s = Scheduler(50, 4, make_policy("lookahead"), lookahead=3, name="tbl")
    s.enqueue(_ids(0, 1, 2))
    s.enqueue(_ids(3, 4, 5))
    s.stage_next()
    snapshot = [t.clone() for t in (s.residency.slot_of, s.residency.row_of, s.residency.pin)]
    with pytest.raises(
        CacheCapacityError, match=r"tbl: .*needs 3 more rows.*only 1 of 4.*at least 6"
    ):
        s.stage_next()
    after = (s.residency.slot_of, s.residency.row_of, s.residency.pin)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after, strict=True))
    assert s.num_unstaged == 1


def test_batch_larger_than_cache_is_refused_at_enqueue():
    s = Scheduler(50, 2, make_policy("lru"), lookahead=1, name="tbl")
    with pytest.raises(CacheCapacityError, match="3 distinct rows but the cache holds 2"):
        s.enqueue(_ids(1, 2, 3, 3))
    assert s.num_unstaged == 0


def test_window_errors():
    s = Scheduler(10, 5, make_policy("lookahead"), lookahead=1)
    s.enqueue(_ids(0))
    s.enqueue(_ids(1))
    with pytest.raises(LookaheadWindowError, match="window full"):
        s.enqueue(_ids(2))
    a, b = s.stage_next(), s.stage_next()
    with pytest.raises(LookaheadWindowError, match="no enqueued batch"):
        s.stage_next()
    with pytest.raises(LookaheadWindowError, match="order"):
        s.release(b)
    s.release(a)
    s.release(b)
    assert int(s.residency.pin.sum()) == 0


@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
@pytest.mark.parametrize("victim_batches", [1, 4])
def test_random_stream_keeps_bijection_and_pins(policy, victim_batches):
    gen = torch.Generator().manual_seed(0)
    s = Scheduler(200, 40, make_policy(policy), lookahead=6, victim_batches=victim_batches)
    in_flight = []
    for _ in range(3):
        s.enqueue(torch.randint(0, 200, (12,), generator=gen))
    for _ in range(60):
        s.enqueue(torch.randint(0, 200, (12,), generator=gen))
        plan = s.stage_next()
        for old in in_flight:  # rows of batches in flight stay where they were
            assert torch.equal(s.residency.slot_of[old.rows], old.slots)
        in_flight.append(plan)
        if len(in_flight) > 2:
            s.residency.dirty[in_flight[0].slots] = True
            s.release(in_flight.pop(0))
        _check_bijection(s)
        assert torch.equal(
            s.residency.row_of[plan.id_slots], s.residency.row_of[plan.slots][plan.inverse]
        )
    assert s.counters.writebacks > 0
