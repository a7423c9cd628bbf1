"""The trace simulator against a brute-force Belady and the policies' defining properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distcache.cache.simulate import simulate


def belady_loads(batches: list[list[int]], capacity: int) -> int:
    """Brute-force Belady for batched requests: evict resident rows not used by the current
    batch whose next use is farthest (never used again counts as farthest)."""
    resident: set[int] = set()
    loads = 0
    for t, batch in enumerate(batches):
        need = set(batch)
        misses = need - resident
        loads += len(misses)
        overflow = len(resident) + len(misses) - capacity
        if overflow > 0:

            def next_use(row: int, t: int = t) -> int:
                for u in range(t + 1, len(batches)):
                    if row in batches[u]:
                        return u
                return len(batches)

            victims = sorted(resident - need, key=next_use, reverse=True)[:overflow]
            resident -= set(victims)
        resident |= misses
    return loads


def zipf_batches(rows: int, batch: int, num: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(batch * num, generator=gen, dtype=torch.float64)
    ranks = (((rows**-0.1 - 1) * u + 1) ** (1 / -0.1)).long() - 1
    return list(((ranks.clamp(0, rows - 1) * 7919) % rows).split(batch))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    trace=st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=5), min_size=1, max_size=25),
    extra=st.integers(0, 8),
)
def test_optimal_equals_brute_force_belady(trace, extra):
    capacity = max(len(set(b)) for b in trace) + extra
    batches = [torch.tensor(b) for b in trace]
    result = simulate(batches, num_rows=16, capacity=capacity, policy="optimal")
    assert result.loads == belady_loads(trace, min(capacity, 16))


@pytest.mark.parametrize("capacity", [60, 120, 300])
def test_optimal_is_a_lower_bound_and_policies_behave(capacity):
    batches = zipf_batches(1000, 40, 80, seed=0)
    results = {
        p: simulate(
            batches, num_rows=1000, capacity=capacity, policy=p, lookahead=6, prefetch_depth=1
        )
        for p in ("optimal", "lookahead", "lru", "lfu")
    }
    opt = results["optimal"].loads
    for name, r in results.items():
        assert r.loads >= opt, name
        assert r.writebacks <= r.loads
        assert r.batches == 80 and r.ids == 80 * 40
    assert results["lookahead"].critical_misses == 0
    assert results["lru"].critical_misses == results["lru"].loads
    assert results["lookahead"].loads < results["lru"].loads


def test_cache_as_large_as_the_trace_only_has_compulsory_misses():
    batches = zipf_batches(500, 30, 40, seed=1)
    unique = torch.cat(batches).unique().numel()
    for policy in ("optimal", "lookahead", "lru", "lfu"):
        r = simulate(batches, num_rows=600, capacity=500, policy=policy)
        assert r.loads == unique == r.unique_ids
        assert r.writebacks == 0
        # A cache of every row loads them all before its first batch, none after.
        r = simulate(batches, num_rows=500, capacity=500, policy=policy)
        assert (r.loads, r.writebacks, r.unique_ids) == (0, 0, unique)


def test_full_window_without_prefetch_matches_optimal():
    batches = zipf_batches(800, 50, 60, seed=2)
    opt = simulate(batches, num_rows=800, capacity=150, policy="optimal")
    la = simulate(
        batches, num_rows=800, capacity=150, policy="lookahead", lookahead=60, prefetch_depth=0
    )
    assert la.loads == opt.loads


def test_longer_window_loads_less_and_approaches_optimal():
    batches = zipf_batches(2000, 80, 120, seed=3)
    opt = simulate(batches, num_rows=2000, capacity=300, policy="optimal").loads
    loads = [
        simulate(batches, num_rows=2000, capacity=300, lookahead=la, prefetch_depth=1).loads
        for la in (1, 16, 119)
    ]
    assert loads[0] >= loads[1] >= loads[2] >= opt
    assert loads[2] <= 1.02 * opt  # the whole trace ahead: Belady but for the pinned batch


def test_counting_from_a_batch_leaves_out_the_warm_up():
    """Rows first touched in the first 10 batches (the warm-up), then only those again: counted
    from batch 10, a cache that holds them all loads nothing; counted from 0, every row once."""
    gen = torch.Generator().manual_seed(4)
    warm = [torch.arange(30 * b, 30 * b + 30) for b in range(10)]  # 300 rows, 30 a batch
    again = [torch.randint(0, 300, (40,), generator=gen) for _ in range(20)]
    for policy in ("optimal", "lookahead", "lru", "lfu"):
        whole = simulate(warm + again, num_rows=1000, capacity=400, policy=policy)
        steady = simulate(warm + again, num_rows=1000, capacity=400, policy=policy, count_from=10)
        assert whole.loads == 300 and (steady.loads, steady.batches) == (0, 20), policy
        assert steady.ids == 20 * 40 and whole.ids == 300 + 20 * 40
    with pytest.raises(ValueError, match="count_from=30: expected 0 <= count_from < 30"):
        simulate(warm + again, num_rows=1000, capacity=400, count_from=30)


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        simulate([torch.tensor([1])], num_rows=4, capacity=2, policy="fifo")
