"""Id samples (`distcache.data.sample`): ids counted per table, bad samples refused."""

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.data.sample import id_counts
from distcache.errors import DistcacheConfigError


def _batch(*per_table: list[int]) -> Batch:
    """One id per sample and table (as Criteo), `per_table[t]` the ids of table t."""
    size = len(per_table[0])
    values = torch.tensor([i for ids in per_table for i in ids], dtype=torch.int64)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{t}" for t in range(len(per_table))],
        values=values,
        lengths=torch.ones(values.numel(), dtype=torch.int32),
    )
    return Batch(
        dense_features=torch.zeros(size, 1), sparse_features=features, labels=torch.zeros(size)
    )


def test_ids_are_counted_per_table():
    batches = [_batch([0, 2, 2], [1, 1, 1]), _batch([2, 3, 0], [0, 1, 4])]
    first, second = id_counts(batches, (4, 5))
    assert (first.rows, first.ids.tolist(), first.counts.tolist()) == (4, [0, 2, 3], [2, 3, 1])
    assert (second.ids.tolist(), second.counts.tolist()) == ([0, 1, 4], [1, 4, 1])
    assert (first.lookups, first.seen) == (6, 3)
    assert first.hottest(2) == [0, 2]  # 2 (3 reads), then 0 (2)
    assert second.hottest(2) == [0, 1]  # 1 (4 reads), then 0 and 4 tied: the lower row


@pytest.mark.parametrize(
    ("batches", "sizes", "match"),
    [
        ([_batch([0, 4])], (4,), "ids of table 0 outside \\[0, 4\\)"),
        ([_batch([0], [1])], (4,), "2 features; the job has 1 tables"),
        ([], (4,), "no batch"),
    ],
)
def test_a_bad_sample_is_refused(batches, sizes, match):
    with pytest.raises(DistcacheConfigError, match=match):
        id_counts(batches, sizes)
