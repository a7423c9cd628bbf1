"""The id checks: `find_invalid_per_feature` finds what `find_invalid` finds from a per-id
feature, from each feature's id count alone, and `first_invalid` names the invalid id a plain
loop over the batch finds first."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distcache.cache.ids import (
    find_invalid,
    find_invalid_per_feature,
    first_invalid,
    raise_if_invalid,
)
from distcache.errors import InvalidIdError


def _reference(values: list[int], counts: list[int], rows: list[int]) -> list[int]:
    """[count, position, value, feature] of the invalid ids, by a loop over the batch."""
    found = []
    position = 0
    for feature, count in enumerate(counts):
        for _ in range(count):
            value = values[position]
            if not 0 <= value < rows[feature]:
                found.append((position, value, feature))
            position += 1
    first = found[0] if found else (0, values[0] if values else 0, 0)
    return [len(found), *first]


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_per_feature_equals_per_id_and_the_reference(
    counts: list[int], seed: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 5, (len(counts),), generator=gen)
    ids_per_feature = torch.tensor(counts)
    values = torch.randint(-2, 7, (sum(counts),), generator=gen, dtype=dtype)
    feature_of_id = torch.repeat_interleave(torch.arange(len(counts)), ids_per_feature)
    bad, count = find_invalid_per_feature(values, ids_per_feature, rows)
    want_bad, want_count = find_invalid(values, rows.index_select(0, feature_of_id))
    assert torch.equal(bad, want_bad)
    assert count.dtype == torch.int64 and count.tolist() == want_count.tolist()
    want = _reference(values.tolist(), counts, rows.tolist())
    assert count.tolist() == [want[0]]
    if want[0]:  # (the record is read only when the count is not 0)
        assert first_invalid(values, ids_per_feature, rows) == want


def test_the_record_names_the_first_invalid_id_past_empty_features() -> None:
    values = torch.tensor([0, 1, 2, 9, 5, -1])  # features 0: [0, 1], 1: none, 2: [2, 9, 5, -1]
    record = first_invalid(values, torch.tensor([2, 0, 4]), torch.tensor([2, 3, 4]))
    assert record == [3, 3, 9, 2]
    with pytest.raises(InvalidIdError, match=r"^f2: id 9 at position 3 is out of range: ids must"):
        raise_if_invalid(record, lambda f: 4, lambda f: f"f{f}")
