"""`CachedEmbeddings` (per-id rows, what `EmbeddingCollection` looks up) against uncached
`nn.Embedding`s: the same rows out, the same rows after training, with caches that evict."""

from __future__ import annotations

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddings, DistcacheConfigError, InvalidIdError
from tests.unit.cache.reference import (
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    train_both,
)


def _check(cached, ref, pairs, tables, *, exact: bool) -> None:
    for step, (out, ref_out) in enumerate(pairs):
        assert out.shape == ref_out.shape, step
        if exact:
            assert torch.equal(out, ref_out), f"rows differ at step {step}"
        else:
            torch.testing.assert_close(out, ref_out, msg=lambda m, s=step: f"step {s}: {m}")
    for t, emb in zip(tables, ref.embs, strict=True):
        if exact:
            assert torch.equal(cached.table_weight(t.name), emb.weight.data), t.name
        else:
            torch.testing.assert_close(cached.table_weight(t.name), emb.weight.data)


@pytest.mark.parametrize("kernel", ["fbgemm", "torch"])
@pytest.mark.parametrize("policy", ["lookahead", "lru"])
@pytest.mark.parametrize("window", [True, False])
def test_sgd_integer_rows_bitwise(policy, window, kernel):
    tables = make_tables([4, 4, 4], [60, 35, 50])
    config = CacheConfig(
        capacity=20, lookahead=3, prefetch_depth=1, policy=policy, learning_rate=1.0,
        kernel=kernel,
    )  # fmt: skip
    batches = make_batches(tables, batch_size=3, num_batches=25, max_len=4, seed=1)
    weights = integer_weights(tables, 0)
    cached, ref, pairs = train_both(
        tables, config, batches, weights=weights, use_window=window, sequence=True
    )
    _check(cached, ref, pairs, tables, exact=True)
    (stats,) = cached.stats().values()  # one width: one cache
    assert stats.evictions > 0 and stats.writebacks > 0
    if policy == "lookahead" and window:
        assert stats.critical_misses == 0
    else:
        assert stats.critical_misses == stats.loads


@pytest.mark.parametrize(
    ("optimizer", "kernel"),
    [("rowwise_adagrad", "fbgemm"), ("rowwise_adagrad", "torch"), ("adam", "torch")],
)
def test_stateful_optimizers_match_torch(optimizer, kernel):
    tables = make_tables([8, 8], [50, 30])
    config = CacheConfig(
        capacity=18,
        lookahead=3,
        prefetch_depth=1,
        optimizer=optimizer,
        learning_rate=0.05,
        eps=1e-6,
        kernel=kernel,
    )
    batches = make_batches(tables, batch_size=3, num_batches=30, max_len=3, seed=4)
    weights = [w / 8 for w in integer_weights(tables, 3)]
    cached, ref, pairs = train_both(tables, config, batches, weights=weights, sequence=True)
    _check(cached, ref, pairs, tables, exact=False)
    (stats,) = cached.stats().values()
    assert stats.writebacks > 0


def test_eval_reads_without_updating():
    tables = make_tables([4], [30])
    seqs = CachedEmbeddings(tables, CacheConfig(capacity=8, learning_rate=1.0))
    before = seqs.table_weight("t0").clone()
    seqs.eval()
    for values, offsets in make_batches(tables, batch_size=3, num_batches=6, max_len=3, seed=2):
        rows = seqs(values, offsets)
        assert rows.shape == (values.numel(), 4) and not rows.requires_grad
        assert torch.equal(rows, before[values])
    assert torch.equal(seqs.table_weight("t0"), before)


def test_tables_of_several_widths_are_refused():
    with pytest.raises(DistcacheConfigError, match="one width and dtype"):
        CachedEmbeddings(make_tables([4, 8], [10, 10]), CacheConfig())


def test_an_invalid_id_raises_before_any_row_changes():
    tables = make_tables([4], [30])
    seqs = CachedEmbeddings(tables, CacheConfig(capacity=8, learning_rate=1.0))
    before = seqs.table_weight("t0").clone()
    with pytest.raises(InvalidIdError, match=r"id 30 .*\[0, 30\)"):
        loss_of(seqs(torch.tensor([1, 30]), torch.tensor([0, 1, 2]))).backward()
    assert torch.equal(seqs.table_weight("t0"), before)
