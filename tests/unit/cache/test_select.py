"""Fixed-shape selection and packing, against sorting and boolean masks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distcache.cache.select import pack, select_largest


def _reference(keys: torch.Tensor, want: int) -> list[int]:
    """The `want` largest keys >= 0, ties to the lowest index, in increasing index order."""
    order = torch.argsort(keys, descending=True, stable=True)
    eligible = order[keys[order] >= 0][:want]
    return sorted(eligible.tolist())


@settings(max_examples=300, deadline=None)
@given(
    m=st.integers(1, 300),
    classes=st.integers(1, 40),
    want_frac=st.floats(0.0, 1.3),
    seed=st.integers(0, 2**16),
)
def test_select_largest_matches_a_stable_sort(m, classes, want_frac, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(-1, classes, (m,), generator=gen)  # few classes: many ties
    want = int(want_frac * m)
    picked, taken, candidates = select_largest(keys, classes, torch.tensor(want), m)
    expected = _reference(keys, want)
    assert int(candidates) == int((keys >= 0).sum())
    assert int(taken) == len(expected)  # fewer than wanted when too few are eligible
    assert picked[: len(expected)].tolist() == expected
    assert torch.all(picked[len(expected) :] == m)  # padding


@pytest.mark.parametrize("m", [100_000])
def test_select_largest_at_scale(m):
    gen = torch.Generator().manual_seed(1)
    keys = torch.randint(-1, 1 << 16, (m,), generator=gen)
    want = 12_345
    picked, taken, _ = select_largest(keys, 1 << 16, torch.tensor(want), 20_000)
    assert int(taken) == want
    assert picked[:want].tolist() == _reference(keys, want)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 50), seed=st.integers(0, 2**16))
def test_pack_equals_boolean_mask(n, seed):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, generator=gen) < 0.5
    values = torch.randint(0, 1000, (n,), generator=gen)
    packed = pack(keep, keep.cumsum(0) - 1, values, n, -7)
    kept = values[keep]
    assert torch.equal(packed[: kept.numel()], kept)
    assert torch.all(packed[kept.numel() :] == -7)
