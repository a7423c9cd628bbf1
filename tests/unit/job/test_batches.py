"""`distcache.job.batches`: each kind of bad training batch is named, and `CheckedBatches`
raises or skips it (the multi-rank skip, through the job: tests/distributed/test_faults.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache import InvalidBatchError
from distcache.job.batches import BatchSpec, CheckedBatches, batch_problem

SPEC = BatchSpec(features=("f0", "f1"), rows=(10, 4), dense_features=3)


def _batch(
    keys=("f0", "f1"),
    values=(1, 9, 2, 3, 0),
    lengths=(2, 1, 1, 1),
    dense=None,
    labels=(0.0, 1.0),
    weights=None,
) -> Batch:
    """Two samples: f0 ids [1, 9] and [2]; f1 ids [3] and [0]."""
    return Batch(
        dense_features=torch.zeros(2, 3) if dense is None else dense,
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=list(keys),
            values=torch.tensor(values),
            lengths=torch.tensor(lengths, dtype=torch.int32),
            weights=None if weights is None else torch.tensor(weights),
        ),
        labels=torch.tensor(labels),
    )


def test_a_good_batch_has_no_problem() -> None:
    assert batch_problem(_batch(), SPEC) is None


@pytest.mark.parametrize(
    ("batch", "problem"),
    [
        (_batch(keys=("f0", "f2")), r"missing \['f1'\], unexpected \['f2'\]"),
        (_batch(keys=("f1", "f0"), values=(1, 2, 3, 3, 0)), "out of order"),
        (_batch(values=(1.0, 9.0, 2.0, 3.0, 0.0)), "ids are torch.float32"),
        (_batch(lengths=(2, 1, 1, 2)), "add up to 6 ids but it holds 5"),
        (_batch(lengths=(3, -1, 1, 2)), "must be >= 0"),
        (_batch(values=(1, 9, 2, 4, 0)), r"'f1' has id 4, outside its table's rows \[0, 4\)"),
        (_batch(values=(1, -1, 2, 3, 0)), "feature 'f0' has id -1"),
        (_batch(dense=torch.zeros(2, 4)), r"dense features are \[2, 4\]; expected \[2, 3\]"),
        (_batch(dense=torch.tensor([[0.0, float("nan"), 0], [0, 0, 0]])), "NaN or infinite"),
        (_batch(labels=(0.0, 2.0)), r"labels are not all finite numbers in \[0, 1\]"),
        (_batch(labels=(0.0, float("inf"))), "labels are not all finite"),
        (_batch(weights=(1.0,) * 5), "per-id weights, which the model's .* do not take"),
    ],
    ids=[
        "keys", "order", "float-ids", "lengths-sum", "negative-length", "id-range",
        "negative-id", "dense-shape", "dense-nan", "label-range", "label-inf", "weights",
    ],
)  # fmt: skip
def test_each_bad_batch_is_named(batch: Batch, problem: str) -> None:
    found = batch_problem(batch, SPEC)
    assert found is not None
    assert re.search(problem, found), found


def _bad() -> Batch:
    return _batch(dense=torch.full((2, 3), float("nan")))


def test_raise_names_the_batch_and_the_way_out() -> None:
    batches = CheckedBatches(iter([_batch(), _bad()]), SPEC, first=7, skip=False)
    assert next(batches) is not None
    with pytest.raises(
        InvalidBatchError, match=r"training batch 8 of rank 0 is bad: .*on_bad_batch"
    ):
        next(batches)


def test_skip_counts_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    good = [_batch(labels=(0.0, 1.0)), _batch(labels=(1.0, 1.0)), _batch(labels=(1.0, 0.0))]
    with caplog.at_level("WARNING", logger="distcache.job.batches"):
        batches = CheckedBatches(
            iter([good[0], _bad(), _bad(), good[1], good[2]]), SPEC, first=0, skip=True
        )
        assert list(batches) == good
    assert batches.skipped == 2
    assert "skipped training batch 1 on every rank: bad here (its dense features" in caplog.text
    assert "skipped training batch 2" in caplog.text


def test_a_weighted_model_needs_finite_weights_per_id() -> None:
    weighted = dataclasses.replace(SPEC, weighted=True)
    assert batch_problem(_batch(weights=(0.5, 1.0, 2.0, 1.0, 0.1)), weighted) is None
    assert "no per-id weights" in batch_problem(_batch(), weighted)
    nan = (0.5, float("nan"), 2.0, 1.0, 0.1)
    assert "weights hold NaN" in batch_problem(_batch(weights=nan), weighted)
