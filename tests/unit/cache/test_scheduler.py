"""The look-ahead scheduler: residency bookkeeping, pins, eviction order, window errors."""

import pytest
import torch

from distcache.cache.plan import LOADS, MISSES, UNIQUE, WRITEBACKS
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.errors import CacheCapacityError, LookaheadWindowError


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64)


def _loads(plan) -> list[int]:
    return plan.load_rows[: int(plan.counts[LOADS])].tolist()


def _check_bijection(s: Scheduler):
    res = s.residency
    resident = res.resident_slots()
    assert torch.equal(res.slot_of[res.row_of[resident]].long(), resident)
    assert int((res.slot_of[: s.num_rows] >= 0).sum()) == resident.numel() <= s.capacity
    assert int(res.slot_of[res.sentinel_row]) == res.sentinel_slot  # the sentinel stays paired


def _check_pins(s: Scheduler):
    """Each slot is pinned once per staged batch that uses it, and by nothing else."""
    expected = torch.zeros(s.capacity + 2, dtype=torch.int32)
    for plan in s.staged:
        expected.index_add_(0, plan.slots, torch.ones_like(plan.slots, dtype=torch.int32))
    assert torch.equal(s.residency.pin[: s.capacity], expected[: s.capacity])


def test_lookahead_evicts_row_with_farthest_next_use():
    s = Scheduler(10, 3, make_policy("lookahead"), lookahead=4)
    for batch in ([0, 1, 2], [3], [0], [1], [2]):
        s.enqueue(_ids(*batch))
    s.release(s.stage_next(), updated=False)
    plan = s.stage_next()  # batch [3]: rows 0, 1, 2 are next used at 2, 3, 4: evict 2
    assert _loads(plan) == [3]
    assert int(plan.counts[WRITEBACKS]) == 0  # nothing was updated (dirty)
    assert s.residency.slot_of[2] == -1
    s.release(plan, updated=False)
    for _ in range(2):
        p = s.stage_next()
        assert int(p.counts[LOADS]) == 0  # 0 and 1 hit
        s.release(p, updated=False)
    _check_bijection(s)


@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
@pytest.mark.parametrize("lookahead", [2, 300])
def test_free_slots_are_taken_before_any_row_is_evicted(policy, lookahead):
    """Once the host can no longer tell that the free slots suffice (a batch of many repeated
    ids), the policy's classes choose: free slots must come before every resident row."""
    s = Scheduler(100, 10, make_policy(policy), lookahead=lookahead)
    s.enqueue(_ids(0, 1, 2, 3))
    s.enqueue(_ids(0, 0, 0, 0, 0, 0, 0, 4))  # 4 + 8 ids > 10 slots: the classes choose
    s.enqueue(_ids(5, 6, 7, 8, 9))
    for _ in range(3):
        plan = s.stage_next()
        assert int(plan.counts[1]) == int(plan.counts[LOADS])  # every miss got a slot
        s.release(plan)
        assert s.counters.evictions == 0
    assert int((s.residency.slot_of[:10] >= 0).sum()) == 10  # the cache is full, nothing lost
    _check_bijection(s)


def test_lookahead_prefers_rows_outside_window_then_least_used():
    s = Scheduler(10, 3, make_policy("lookahead"), lookahead=4)
    for batch in ([1, 2], [2], [0], [5], [0]):
        s.enqueue(_ids(*batch))
    for _ in range(3):
        s.release(s.stage_next(), updated=False)
    plan = s.stage_next()  # [5]: 0 is used next; 1 and 2 are not: 1 was used by fewer batches
    assert _loads(plan) == [5]
    assert s.residency.slot_of[1] == -1
    assert s.residency.slot_of[0] >= 0 and s.residency.slot_of[2] >= 0


def test_duplicates_and_the_inverse():
    s = Scheduler(20, 8, make_policy("lookahead"), lookahead=2)
    ids = _ids(7, 3, 7, 7, 9, 3)
    s.enqueue(ids)
    plan = s.stage_next()
    sentinel = s.residency.sentinel_row
    assert plan.batch.rows.tolist() == [3, 7, 9, sentinel, sentinel, sentinel]
    assert plan.inverse.tolist() == [1, 0, 1, 1, 2, 0]
    assert torch.equal(plan.batch.ids, ids)
    assert int(plan.counts[UNIQUE]) == 3 and _loads(plan) == [3, 7, 9]
    assert torch.equal(s.residency.row_of[plan.id_slots], ids)


@pytest.mark.parametrize("n", [8_191, 8_192, 20_000, 32_767, 32_768])
def test_dedup_at_every_sort_size(n):
    """Batches the window pads for torch's radix sort (`Window._sort`) dedup as `unique`,
    padding ids (the sentinel row) included."""
    gen = torch.Generator().manual_seed(n)
    s = Scheduler(5_000, 4_999, make_policy("lookahead"), lookahead=1)
    ids = torch.randint(0, 5_001, (n,), generator=gen)  # 5_000: the sentinel row
    s.enqueue(ids)
    plan = s.stage_next()
    unique = torch.unique(ids[ids != 5_000])
    assert torch.equal(plan.batch.rows[: unique.numel()], unique)
    assert bool((plan.batch.rows[unique.numel() :] == 5_000).all())
    assert torch.equal(plan.batch.ids, ids)
    assert torch.equal(s.residency.row_of[plan.id_slots[ids != 5_000]], ids[ids != 5_000])


def test_pinned_rows_are_never_evicted():
    s = Scheduler(50, 7, make_policy("lru"), lookahead=3)
    for batch in ([0, 1, 2], [3, 4], [5, 6], [7, 8, 9]):
        s.enqueue(_ids(*batch))
    first, second, third = s.stage_next(), s.stage_next(), s.stage_next()
    s.release(first)  # only the first batch's slots may be reused
    fourth = s.stage_next()
    loaded = fourth.load_slots[: int(fourth.counts[LOADS])]
    assert sorted(loaded.tolist()) == sorted(first.id_slots.tolist())
    for plan in (second, third):
        assert torch.equal(s.residency.slot_of[plan.batch.ids].long(), plan.id_slots)
    _check_pins(s)


def test_too_many_misses_are_recorded_and_lose_nothing():
    s = Scheduler(50, 4, make_policy("lookahead"), lookahead=3, name="tbl")
    s.enqueue(_ids(0, 1, 2))
    s.enqueue(_ids(3, 4, 5))
    first = s.stage_next()
    s.residency.dirty[first.slots[:3]] = True  # as if trained while pinned: must not be evicted
    plan = s.stage_next()  # needs 3 slots, 1 is free
    counts = plan.counts.tolist()
    assert counts[MISSES] == 3 and counts[LOADS] == 1
    error = s.capacity_error(plan, counts)
    assert error is not None
    assert "tbl: cache too small to stage batch 1: it needs 3 more rows but only 1 of 4" in str(
        error
    )
    assert "Use a capacity of at least 6 rows" in str(error)
    assert torch.equal(s.residency.slot_of[_ids(0, 1, 2)].long(), first.slots[:3])  # kept
    missing = plan.id_slots == s.residency.sentinel_slot  # rows without a slot read zeros
    assert int(missing.sum()) == 2
    _check_bijection(s)
    _check_pins(s)


def test_batch_larger_than_cache_is_recorded():
    s = Scheduler(50, 2, make_policy("lru"), lookahead=1, name="tbl")
    s.enqueue(_ids(1, 2, 3, 3))
    plan = s.stage_next()
    error = s.capacity_error(plan, plan.counts.tolist())
    assert "tbl: a batch uses 3 distinct rows but the cache holds 2" in str(error)
    _check_bijection(s)


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
    assert int(s.residency.pin[: s.capacity].sum()) == 0


def test_drop_window_keeps_rows_and_dirt():
    s = Scheduler(30, 6, make_policy("lookahead"), lookahead=4)
    for batch in ([0, 1], [2, 3], [4, 5], [6]):
        s.enqueue(_ids(*batch))
    s.release(s.stage_next())  # rows 0, 1 trained: dirty
    s.stage_next()
    s.drop_window()
    assert s.num_staged == s.num_unstaged == 0
    assert int(s.residency.pin.sum()) == 0
    assert int(s.residency.dirty[: s.capacity].sum()) == 2
    s.enqueue(_ids(0, 9))
    plan = s.stage_next()
    assert _loads(plan) == [9]  # row 0 is still resident
    _check_bijection(s)


@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
@pytest.mark.parametrize("lookahead", [1, 6, 40])
def test_random_stream_keeps_bijection_and_pins(policy, lookahead):
    gen = torch.Generator().manual_seed(0)
    s = Scheduler(200, 40, make_policy(policy), lookahead=lookahead)
    in_flight = []
    depth = min(2, lookahead)
    for _ in range(depth):
        s.enqueue(torch.randint(0, 200, (12,), generator=gen))
    for _ in range(120):
        while s.num_unstaged + s.num_staged <= lookahead:
            s.enqueue(torch.randint(0, 200, (12,), generator=gen))
        plan = s.stage_next()
        assert int(plan.counts[LOADS]) == int(plan.counts[MISSES])
        for old in in_flight:  # rows of batches in flight stay where they were
            assert torch.equal(s.residency.slot_of[old.batch.ids].long(), old.id_slots)
        in_flight.append(plan)
        if len(in_flight) > depth:
            s.release(in_flight.pop(0))
        _check_bijection(s)
        _check_pins(s)
        assert torch.equal(s.residency.row_of[plan.id_slots], plan.batch.ids)
    assert s.counters.writebacks > 0


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
@pytest.mark.parametrize("n", [16, 8_191, 40_000])
def test_a_cache_of_every_row_stages_batches_in_place(policy, n):
    """`_stage_whole`: once its rows are loaded (`fill_whole`), row r is in slot r; a plan
    moves, evicts and pins nothing, its slots are the batch's rows deduplicated without a sort
    (`Window.distinct_device`) as `unique` would, and it marks the rows it trained dirty."""
    gen = torch.Generator().manual_seed(n)
    s = Scheduler(300, 300, make_policy(policy), lookahead=2)
    s.enqueue(_ids(1, 2))
    with pytest.raises(LookaheadWindowError, match=r"call fill_whole\(\)"):
        s.stage_next()
    s.clear()
    s.fill_whole()
    _check_bijection(s)
    assert s.residency.num_resident() == 300
    seen: set[int] = set()
    for _ in range(4):
        ids = torch.randint(0, 301, (n,), generator=gen)  # 300: the sentinel row (padding)
        s.enqueue(ids)
        plan = s.stage_next()
        real = ids[ids != 300]
        assert torch.equal(plan.id_slots, ids)  # the sentinel row is the sentinel slot
        assert torch.equal(plan.batch.ids, ids)
        distinct = plan.slots[plan.batch.valid]
        assert sorted(distinct.tolist()) == torch.unique(real).tolist()  # each row once
        assert torch.equal(plan.batch.rows[plan.inverse], ids)  # each id to its row
        assert plan.counts.tolist() == [distinct.numel(), 0, 0, 0, 0, 0, 0]
        assert s.residency.num_pinned() == 0
        s.release(plan, updated=True)
        seen |= set(real.tolist())
    assert torch.equal(s.residency.dirty_slots(), torch.tensor(sorted(seen)))
    assert s.counters.loads == s.counters.writebacks == 0
    _check_bijection(s)
    with pytest.raises(CacheCapacityError, match="fills a cache of every row"):
        Scheduler(300, 299, make_policy(policy), lookahead=2).fill_whole()


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
@pytest.mark.parametrize(
    ("rows", "capacity", "steps"),
    [(20_000, 5_000, 12), (100_000, 12_000, 24)],  # every slot scored; the sweep and the queue
)
def test_a_full_cache_offers_no_free_slots_and_chooses_the_same(policy, rows, capacity, steps):
    """Once the host sees a plan leave no free slot (`note_counts`), victims are chosen
    without free-slot candidates: the same plans as a scheduler that keeps offering them,
    whether every slot is scored (a small cache) or the candidates (`Scheduler._scan`)."""
    gen = torch.Generator().manual_seed(5)
    told = Scheduler(rows, capacity, make_policy(policy), lookahead=2)
    untold = Scheduler(rows, capacity, make_policy(policy), lookahead=2)
    assert (told._scan(1_500) < capacity) == (capacity > 5_000)
    for step in range(steps):
        ids = torch.randint(0, rows, (1_500,), generator=gen)
        plans = [s.stage_next() if s.enqueue(ids) >= 0 else None for s in (told, untold)]
        told.note_counts(plans[0].counts.tolist())
        for name in ("slots", "load_rows", "load_slots", "writeback_rows", "counts"):
            assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), (step, name)
        for s, plan in zip((told, untold), plans, strict=True):
            s.release(plan, updated=True)
        _check_bijection(told)
    assert told._full and not untold._full  # the cache filled, and only one was told
    assert told.counters.evictions > 0


def test_a_whole_cache_dedups_with_the_last_occurrence_of_each_row():
    """`Window.distinct_device`'s choice among a row's occurrences is a max, the same on every
    device (a plain scatter's winner is unspecified on CUDA: two runs' plans differed there)."""
    from distcache.cache.window import Window

    window = Window(10, torch.device("cpu"))
    ids = torch.tensor([3, 7, 3, 10, 7, 3, 1, 10])  # 10: the sentinel row (padding)
    real = ids != window.sentinel_row
    rows, rep, valid, positions = window.distinct_device(ids, torch.tensor([0, 100]), real)
    assert rep.tolist() == [5, 4, 5, 7, 4, 5, 6, 7]
    assert valid.tolist() == [False, False, False, False, True, True, True, False]
    assert rows.tolist() == [10, 10, 10, 10, 7, 3, 1, 10]
    assert torch.equal(rows[rep][real], ids[real]) and positions.tolist() == list(range(100, 108))
