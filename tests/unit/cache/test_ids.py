"""`find_invalid_per_feature` finds what `find_invalid` finds from a per-id feature, from each
feature's id count alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distcache.cache.ids import find_invalid, find_invalid_per_feature, raise_if_invalid
from distcache.errors import InvalidIdError


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_per_feature_equals_per_id(counts: list[int], seed: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 5, (len(counts),), generator=gen)
    ids_per_feature = torch.tensor(counts)
    values = torch.randint(-2, 7, (sum(counts),), generator=gen, dtype=dtype)
    feature_of_id = torch.repeat_interleave(torch.arange(len(counts)), ids_per_feature)
    bad, record = find_invalid_per_feature(values, ids_per_feature, rows)
    want_bad, want_record = find_invalid(values, feature_of_id, rows)
    assert torch.equal(bad, want_bad)
    assert record.dtype == torch.int64 and record.tolist() == want_record.tolist()


def test_the_record_names_the_first_invalid_id_past_empty_features() -> None:
    values = torch.tensor([0, 1, 2, 9, 5, -1])  # features 0: [0, 1], 1: none, 2: [2, 9, 5, -1]
    _, record = find_invalid_per_feature(values, torch.tensor([2, 0, 4]), torch.tensor([2, 3, 4]))
    assert record.tolist() == [3, 3, 9, 2]
    with pytest.raises(InvalidIdError, match=r"^f2: id 9 at position 3 is out of range: ids must"):
        raise_if_invalid(record.tolist(), lambda f: 4, lambda f: f"f{f}")
