"""Bad input: a clear error naming the table, the value and what is allowed; nothing lost."""

import pytest
import torch

from distcache import (
    CacheCapacityError,
    CacheConfig,
    CachedEmbeddingBags,
    DistcacheConfigError,
    InvalidIdError,
    TableSpec,
)
from tests.unit.cache.reference import integer_weights, loss_of, make_batches, make_tables


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, r"capacity=0 .*int >= 1"),
        ({"capacity": -3}, r"capacity=-3"),
        ({"capacity": 1.5}, r"capacity=1.5 .*fraction in \(0, 1\]"),
        ({"capacity": 0.0}, r"capacity=0.0"),
        ({"capacity": True}, r"capacity=True"),
        ({"capacity": "5%"}, r"capacity='5%'"),
        ({"lookahead": -1}, r"lookahead=-1 .*int >= 0"),
        ({"lookahead": 2, "prefetch_depth": 3}, r"prefetch_depth=3 .*at most lookahead=2"),
        ({"policy": "fifo"}, r"policy='fifo' .*'lookahead', 'lru', 'lfu'"),
        ({"staging": "uva"}, r"staging='uva' .*'worker', 'direct'"),
        ({"hot_reduce": "some"}, r"hot_reduce='some' .*'all', 'touched'"),
        ({"optimizer": "lamb"}, r"optimizer='lamb' .*'sgd'"),
        ({"learning_rate": -0.1}, r"learning_rate=-0.1"),
        ({"beta1": 1.0}, r"beta1=1.0 .*\[0, 1\)"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(DistcacheConfigError, match=match):
        CacheConfig(**kwargs)


def test_capacity_rows():
    assert CacheConfig(capacity=0.02).capacity_rows(1000) == 20
    assert CacheConfig(capacity=0.0001).capacity_rows(1000) == 1
    assert CacheConfig(capacity=1.0).capacity_rows(1000) == 1000
    assert CacheConfig(capacity=5000).capacity_rows(1000) == 1000


def test_table_errors():
    with pytest.raises(DistcacheConfigError, match=r"table 'a': num_embeddings=0"):
        TableSpec(name="a", num_embeddings=0, embedding_dim=4)
    with pytest.raises(DistcacheConfigError, match=r"embedding_dim=-1"):
        TableSpec(name="a", num_embeddings=3, embedding_dim=-1)
    with pytest.raises(DistcacheConfigError, match=r"pooling='max'"):
        TableSpec(name="a", num_embeddings=3, embedding_dim=4, pooling="max")
    for capacity, allowed in ((0, "an int >= 1"), (1.5, r"a fraction in \(0, 1\]"), ("5", "")):
        with pytest.raises(DistcacheConfigError, match=rf"table 'a': capacity=.* {allowed}"):
            TableSpec(name="a", num_embeddings=3, embedding_dim=4, capacity=capacity)
    t = TableSpec(name="a", num_embeddings=3, embedding_dim=4)
    with pytest.raises(DistcacheConfigError, match=r"duplicate table names \['a'\]"):
        CachedEmbeddingBags([t, t], CacheConfig())


@pytest.mark.parametrize(("bad", "match"), [(-1, r"id -1"), (30, r"id 30"), (2**40, r"id 1099")])
def test_bad_ids_name_table_value_and_range_and_change_nothing(bad, match):
    tables = make_tables([4, 4], [20, 30])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=10, learning_rate=1.0))
    good = make_batches(tables, batch_size=2, num_batches=1, max_len=2, seed=0)[0]
    values = torch.tensor([1, 2, bad])
    offsets = torch.tensor([0, 1, 2, 2, 3])  # the bad id is in table t1's second bag
    before = [cached.table_weight(t.name).clone() for t in tables]
    error = rf"table 't1' \(feature 1\): {match}\d* at position 2.* \[0, 30\).*not trained"
    cached.enqueue(*good)
    cached.enqueue(values, offsets)  # checked on the device: no read-back here
    loss_of(cached(*good)).backward()
    with pytest.raises(InvalidIdError, match=error):  # raised at the bad batch's lookup
        cached(values, offsets)
    with pytest.raises(InvalidIdError, match=error):  # and on the critical path
        cached(values, offsets)
    (engine,) = cached.engines
    assert engine.scheduler.num_unstaged == 0 and engine.scheduler.num_staged == 0
    trained = [cached.table_weight(t.name).clone() for t in tables]
    assert not all(torch.equal(a, b) for a, b in zip(before, trained, strict=True))
    # The bad batch changed nothing, and the cache goes on.
    loss_of(cached(*good)).backward()
    cached2 = CachedEmbeddingBags(tables, CacheConfig(capacity=10, learning_rate=1.0))
    for _ in range(2):
        loss_of(cached2(*good)).backward()
    for t in tables:
        assert torch.equal(cached.table_weight(t.name), cached2.table_weight(t.name))


def test_bad_ids_raise_even_if_the_caller_changes_its_ids_after_enqueue():
    """The check counts invalid ids on the device when a batch is enqueued, and the message is
    made from the batch's ids only on the error path: a caller that reuses its id buffer
    before the lookup still gets the error (with the ids it now holds), and nothing trains."""
    tables = make_tables([4, 4], [20, 30])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=10, learning_rate=1.0))
    before = [cached.table_weight(t.name).clone() for t in tables]
    values, offsets = torch.tensor([1, 2, 31]), torch.tensor([0, 1, 2, 2, 3])
    cached.enqueue(values, offsets)
    values[2] = 3  # the buffer reused: valid now
    with pytest.raises(InvalidIdError, match=r"1 invalid id\(s\) in this batch"):
        cached(values, offsets)
    for t, weight in zip(tables, before, strict=True):
        assert torch.equal(cached.table_weight(t.name), weight)


def test_cache_too_small_for_one_batch():
    tables = make_tables([4], [50])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=3))
    with pytest.raises(CacheCapacityError, match="uses 5 distinct rows but the cache holds 3"):
        cached(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 5]))
    cached(torch.tensor([1, 2, 3]), torch.tensor([0, 3]))  # still usable


def test_cache_too_small_for_batches_in_flight_loses_nothing():
    tables = make_tables([4], [50])
    weights = integer_weights(tables, 0)
    config = CacheConfig(capacity=6, lookahead=2, prefetch_depth=2, learning_rate=1.0)
    cached = CachedEmbeddingBags(tables, config)
    cached.load_table_weight("t0", weights[0])
    batches = [
        (torch.tensor(ids), torch.tensor([0, len(ids)]))
        for ids in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10])
    ]
    loss_of(cached(*batches[0])).backward()  # rows 0, 1, 2 updated and dirty
    cached.enqueue(*batches[1])
    cached.enqueue(*batches[2])
    cached.prefetch()  # [3..6] evicts a dirty row; [7..10] does not fit beside it
    loss_of(cached(*batches[1])).backward()
    with pytest.raises(
        CacheCapacityError,
        match=r"needs 4 more rows but only 2 of 6.*at least 8 rows, or a smaller prefetch_depth",
    ):
        cached(*batches[2])
    step = torch.tensor([-1.0, 0.0, 1.0, -1.0])  # loss_of's gradient per column
    expected = weights[0].clone()
    expected[[0, 1, 2, 3, 4, 5, 6]] -= step
    assert torch.equal(cached.table_weight("t0"), expected)  # no update was lost
    assert cached.engines[0].scheduler.num_staged == 0  # the window was dropped


def test_empty_batches_and_empty_bags():
    tables = make_tables([4, 3], [20, 10], ["sum", "mean"])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=5))
    empty = cached(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert empty.shape == (0, 7)
    out = cached(torch.tensor([3]), torch.tensor([0, 0, 1, 1, 1]))  # B=2, only one bag non-empty
    assert out.shape == (2, 7)
    assert torch.equal(out[0], torch.zeros(7))
    assert torch.equal(out[1, 4:], torch.zeros(3))
    assert torch.equal(out[1, :4], cached.table_weight("t0")[3])
    loss_of(out).backward()


def test_offsets_must_cover_every_table():
    cached = CachedEmbeddingBags(make_tables([4, 4], [5, 5]), CacheConfig())
    with pytest.raises(ValueError, match=r"offsets has 4 entries; expected F \* B \+ 1 with F=2"):
        cached(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3]))


def test_a_batch_too_large_for_one_cache_is_trained_by_none():
    tables = [
        TableSpec(name="wide", num_embeddings=100, embedding_dim=8),
        TableSpec(name="narrow", num_embeddings=100, embedding_dim=4),
    ]
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=3, learning_rate=1.0))
    before = [cached.table_weight(t.name).clone() for t in tables]
    values = torch.tensor([1, 2, 3, 4, 5])  # wide: 1 row; narrow: 4 rows > 3 slots
    offsets = torch.tensor([0, 1, 5])
    cached.enqueue(values, offsets)
    with pytest.raises(CacheCapacityError, match="narrow: a batch uses 4 distinct rows"):
        cached(values, offsets)
    assert [e.scheduler.num_unstaged + e.scheduler.num_staged for e in cached.engines] == [0, 0]
    for t, w in zip(tables, before, strict=True):
        assert torch.equal(cached.table_weight(t.name), w)


def test_forward_must_follow_enqueue_order():
    tables = make_tables([4], [30])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=10))
    cached.enqueue(torch.tensor([1, 2]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="does not match the oldest enqueued batch"):
        cached(torch.tensor([1, 2, 3]), torch.tensor([0, 3]))
    cached(torch.tensor([1, 2]), torch.tensor([0, 2]))  # the enqueued batch is still next
