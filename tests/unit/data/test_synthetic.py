"""The synthetic click log: determinism, id ranges and popularity, learnable labels, speed."""

import dataclasses
import time

import numpy as np
import pytest
import torch

from distcache.data.criteo import CRITEO_KAGGLE_TABLE_SIZES
from distcache.data.synthetic import SyntheticClickLog, SyntheticConfig, synthetic_preset
from distcache.errors import DistcacheConfigError

SMALL = SyntheticConfig(table_sizes=(50, 1000, 7), alpha=(1.1, 0.9, 0.0), batch_size=64)


def _same(a, b) -> bool:
    ka, kb = a.sparse_features, b.sparse_features
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and torch.equal(ka.values(), kb.values())
        and torch.equal(ka.lengths(), kb.lengths())
        and ka.keys() == kb.keys()
    )


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC (scores are continuous: no ties)."""
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_deterministic_per_seed_rank_and_index():
    a, b = (
        SyntheticClickLog(SMALL, rank=1, world_size=2),
        SyntheticClickLog(SMALL, rank=1, world_size=2),
    )
    assert _same(a.batch(3), b.batch(3))
    assert _same(next(a.iter_from(3)), a.batch(3))
    assert len(list(a.iter_from(98))) == 2 == SMALL.num_batches - 98
    other_rank = SyntheticClickLog(SMALL, rank=0, world_size=2)
    other_seed = SyntheticClickLog(dataclasses.replace(SMALL, seed=1), rank=1, world_size=2)
    assert not _same(a.batch(3), other_rank.batch(3))
    assert not _same(a.batch(3), other_seed.batch(3))
    # Local batch i of rank r is global batch i * world + r: the log does not depend on world.
    single = SyntheticClickLog(SMALL)
    assert _same(a.batch(3), single.batch(3 * 2 + 1))


def test_batch_layout_and_ids_in_range():
    config = synthetic_preset("criteo-kaggle:scale=1000,batch_size=32")
    batch = SyntheticClickLog(config).batch(0)
    assert batch.dense_features.shape == (32, 13) and batch.dense_features.dtype == torch.float32
    assert batch.labels.shape == (32,) and set(batch.labels.tolist()) <= {0.0, 1.0}
    kjt = batch.sparse_features
    assert kjt.keys() == [f"f{i}" for i in range(26)] and kjt.stride() == 32
    for key, rows in zip(kjt.keys(), config.table_sizes, strict=True):
        ids = kjt[key].values()
        assert ids.numel() == 32 and 0 <= int(ids.min()) and int(ids.max()) < rows


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.3])
@pytest.mark.parametrize("hash_ids", [False, True])
def test_frequency_follows_the_exponent(alpha, hash_ids):
    config = SyntheticConfig(
        table_sizes=(2000,), alpha=alpha, batch_size=100_000, hash_ids=hash_ids
    )
    ids = SyntheticClickLog(config).batch(0).sparse_features.values().numpy()
    counts = np.sort(np.bincount(ids, minlength=2000))[::-1]  # by popularity: undoes the map
    rank = np.arange(1, 101)
    slope = np.polyfit(np.log(rank), np.log(counts[:100]), 1)[0]
    assert slope == pytest.approx(-alpha, abs=0.08)
    assert counts[0] / ids.size == pytest.approx(
        1 / np.sum(np.arange(1, 2001.0) ** -alpha), rel=0.05
    )


def test_hashing_spreads_hot_rows():
    plain = SyntheticConfig(table_sizes=(10_000,), alpha=1.2, batch_size=4096, hash_ids=False)
    hashed = SyntheticConfig(table_sizes=(10_000,), alpha=1.2, batch_size=4096)
    ids_plain = SyntheticClickLog(plain).batch(0).sparse_features.values()
    ids_hashed = SyntheticClickLog(hashed).batch(0).sparse_features.values()
    assert float((ids_plain < 100).float().mean()) > 0.5  # hot rows at small ids
    assert float((ids_hashed < 100).float().mean()) < 0.1


@pytest.mark.parametrize("hash_ids", [False, True])
def test_rows_of_ranks_are_the_ids_drawn_most(hash_ids):
    config = SyntheticConfig(table_sizes=(10_000,), alpha=1.2, batch_size=4096, hash_ids=hash_ids)
    log = SyntheticClickLog(config)
    ids = log.batch(0).sparse_features.values().numpy()
    counts = np.bincount(ids, minlength=10_000)
    top = set(np.argsort(-counts, kind="stable")[:3].tolist())
    assert top == set(log.rows_of_ranks(0, range(3)).tolist())
    with pytest.raises(DistcacheConfigError, match="ranks must lie in"):
        log.rows_of_ranks(0, [10_000])


def test_labels_are_learnable():
    log = SyntheticClickLog(synthetic_preset("criteo-kaggle:scale=1000,batch_size=2048"))
    batches = [log.batch(i) for i in range(4)]
    logits = np.concatenate([log.hidden_logit(b).numpy() for b in batches])
    labels = np.concatenate([b.labels.numpy() for b in batches])
    assert 0.15 < labels.mean() < 0.5
    assert _auc(logits, labels) > 0.7


def test_variable_pooling_makes_empty_bags():
    config = SyntheticConfig(
        table_sizes=(100, 5000), pooling=3, variable_pooling=True, batch_size=256
    )
    log = SyntheticClickLog(config)
    batch = log.batch(0)
    lengths = batch.sparse_features.lengths()
    assert int(lengths.min()) == 0 and int(lengths.max()) == 3
    assert batch.sparse_features.values().numel() == int(lengths.sum())
    assert torch.isfinite(log.hidden_logit(batch)).all()


def test_a_40m_row_table_is_fast():
    log = SyntheticClickLog(SyntheticConfig(table_sizes=(40_000_000,), batch_size=8192))
    log.batch(0)
    start = time.perf_counter()
    ids = log.batch(1).sparse_features.values()
    assert time.perf_counter() - start < 0.25
    assert int(ids.max()) < 40_000_000


def test_dataloader_workers_keep_the_order():
    log = SyntheticClickLog(SyntheticConfig(table_sizes=(100,), batch_size=4, num_batches=6))
    loader = torch.utils.data.DataLoader(log, batch_size=None, num_workers=2)
    assert all(_same(a, b) for a, b in zip(loader, log, strict=True))


def test_presets():
    assert synthetic_preset("criteo-kaggle").table_sizes == CRITEO_KAGGLE_TABLE_SIZES
    terabyte = synthetic_preset("criteo-terabyte:scale=1e3,alpha=1.1,hash_ids=false,seed=4")
    assert max(terabyte.table_sizes) == 39979 and min(terabyte.table_sizes) == 1
    assert terabyte.alphas == (1.1,) * 26 and not terabyte.hash_ids and terabyte.seed == 4
    with pytest.raises(DistcacheConfigError, match="criteo-kaggle"):
        synthetic_preset("criteo")
    with pytest.raises(DistcacheConfigError, match="allowed: .*'scale'"):
        synthetic_preset("tiny:rows=3")
    with pytest.raises(DistcacheConfigError, match="batch_size must be an integer"):
        synthetic_preset("tiny:batch_size=1.5")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"table_sizes": ()}, "table_sizes"),
        ({"table_sizes": (0, 5)}, r"table_sizes\[0\]"),
        ({"table_sizes": (2**32,)}, "table_sizes"),
        ({"alpha": -0.5}, "alpha"),
        ({"alpha": (1.0, 1.0)}, "alpha"),
        ({"alpha": "1.0"}, "alpha"),
        ({"pooling": 0}, "pooling"),
        ({"batch_size": 0}, "batch_size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_config_is_validated(change, field):
    with pytest.raises(DistcacheConfigError, match=field):
        SyntheticConfig(**{"table_sizes": (10, 20, 30), **change})
    with pytest.raises(DistcacheConfigError, match="rank"):
        SyntheticClickLog(SMALL, rank=2, world_size=2)


def test_weighted_log_adds_weights_and_keeps_the_rest():
    plain = SyntheticClickLog(SMALL, rank=1, world_size=2)
    weighted = SyntheticClickLog(dataclasses.replace(SMALL, weighted=True), rank=1, world_size=2)
    a, b = plain.batch(5), weighted.batch(5)
    assert _same(a, b)  # the same ids, lengths, dense features and labels
    assert a.sparse_features.weights_or_none() is None
    w = b.sparse_features.weights()
    assert w.dtype == torch.float32 and w.numel() == b.sparse_features.values().numel()
    assert float(w.min()) > 0 and float(w.max()) <= 1 and len(set(w.tolist())) > 1
    assert torch.equal(w, weighted.batch(5).sparse_features.weights())  # deterministic
