"""A cache too small for its batches in flight is found and raised before the first batch
(`distcache.cache.capacity`, `CachedEmbeddingBags(ids_per_batch=...)`)."""

import dataclasses
import logging

import pytest
import torch

from distcache import CacheCapacityError, CacheConfig, CachedEmbeddingBags, DistcacheConfigError
from distcache.cache.capacity import per_table, pinned_batches, shared_capacity, shortfall
from tests.unit.cache.reference import integer_weights, make_batches, make_tables, train_both


def test_a_shortfall_names_the_capacity_that_holds_the_batches_in_flight():
    config = CacheConfig(capacity=0.05, lookahead=4, prefetch_depth=2)
    assert pinned_batches(config) == 3
    assert pinned_batches(CacheConfig(policy="lru", lookahead=0, prefetch_depth=0)) == 1
    short = shortfall("user", config, 1000, 82)  # 50 rows < 3 x 82
    assert (short.capacity_rows, short.needed_rows, short.whole) == (50, 246, False)
    assert short.raised(config).capacity == 246 and short.raised(config).prefetch_depth == 2
    message = short.message()
    assert "table 'user': capacity 0.05 holds 50 of its 1,000 rows" in message
    assert "Set capacity >= 246 rows (0.246 of the table)" in message
    assert "\n" not in message
    whole = shortfall("user", config, 200, 82)
    assert (
        whole.whole and whole.raised(config).capacity == 1.0 and "cached whole" in whole.message()
    )
    assert shortfall("user", config, 1000, 16) is None  # 50 >= 48
    assert shortfall("user", CacheConfig(capacity=246, prefetch_depth=2), 1000, 82) is None


def test_a_shared_cache_covers_a_short_table_with_the_others_spare_rows():
    config = CacheConfig(capacity=0.1, lookahead=1, prefetch_depth=1)
    # 'a' holds 10 rows but needs 40; 'b' holds 100 and needs 40: 60 spare cover 'a'.
    assert shared_capacity([("a", 100, 20, config), ("b", 1000, 20, config)]) == (110, [])
    # 'b' of unknown use lends nothing: 'a' is raised to 40.
    capacity, short = shared_capacity([("a", 100, 20, config), ("b", 1000, None, config)])
    assert capacity == 140 and [s.table for s in short] == ["a"]
    capacity, short = shared_capacity([("a", 100, 20, config), ("b", 1000, 60, config)])
    assert capacity == 160 and [s.table for s in short] == ["a", "b"]


def test_a_shared_cache_adds_up_each_tables_own_capacity():
    config = CacheConfig(capacity=0.1, lookahead=1, prefetch_depth=1)
    whole = dataclasses.replace(config, capacity=1.0)
    # 'a' cached whole (100 rows, holds its 40 in flight), 'b' at 10 % (100 rows, 60 spare).
    assert shared_capacity([("a", 100, 20, whole), ("b", 1000, 20, config)]) == (200, [])
    # A capacity of its own that is short is raised as the config's would be.
    capacity, short = shared_capacity(
        [("a", 100, 20, dataclasses.replace(config, capacity=5)), ("b", 1000, None, config)]
    )
    assert capacity == 140 and short[0].table == "a" and short[0].capacity == 5


def test_ids_per_batch_is_checked():
    names = ["a", "b"]
    assert per_table(None, names) == [None, None]
    assert per_table(3, names) == [3, 3]
    assert per_table({"b": 2.5}, names) == [None, 2.5]
    with pytest.raises(DistcacheConfigError, match="expected one per table"):
        per_table([1], names)
    with pytest.raises(DistcacheConfigError, match=r"names \['c'\], which are not tables"):
        per_table({"c": 1}, names)
    with pytest.raises(DistcacheConfigError, match="of table 'a' is -1: expected a number >= 0"):
        per_table(-1, names)


def test_a_module_told_its_batches_raises_a_short_cache_and_trains_them(caplog):
    tables = make_tables([4, 4], [400, 300])
    config = CacheConfig(capacity=0.02, lookahead=3, prefetch_depth=2, learning_rate=1.0)
    batches = make_batches(tables, batch_size=8, num_batches=12, max_len=3, seed=2)
    weights = integer_weights(tables, 0)
    # Unaided, the 14-row cache cannot stage the batches in flight.
    with pytest.raises(CacheCapacityError):
        train_both(tables, config, batches, weights=weights)
    # Told a batch holds at most 24 ids a table, it is raised before the first batch, says so,
    # and trains as plain nn.EmbeddingBag.
    with caplog.at_level(logging.WARNING, logger="distcache.cache.capacity"):
        cached, ref, pairs = train_both(tables, config, batches, weights=weights, ids_per_batch=24)
    (said,) = [r.getMessage() for r in caplog.records]  # one line for the two tables
    assert "2 tables' caches hold fewer rows than the distinct rows of their 3 batch" in said
    assert "'t0' 8 -> 72 of 400, 't1' 6 -> 72 of 300. Set their capacity" in said, said
    assert cached.stats()["t0+t1"].capacity == 144
    for out, ref_out in pairs:
        assert torch.equal(out, ref_out)
    # A cache that holds them is left as it is, silently.
    caplog.clear()
    big = CachedEmbeddingBags(tables, CacheConfig(capacity=0.5), ids_per_batch=24)
    assert big.stats()["t0+t1"].capacity == 350 and not caplog.records
