import pytest
import torch

from distcache.cache.select import largest


@pytest.mark.parametrize("m", [1, 10, 5000, 100_000])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("distinct", [2, 1000, 1 << 40])
def test_largest_matches_stable_sort(m, frac, distinct):
    gen = torch.Generator().manual_seed(m)
    keys = torch.randint(0, distinct, (m,), generator=gen)  # few distinct values: many ties
    n = int(frac * m)
    expected = torch.argsort(keys, descending=True, stable=True)[:n].sort().values
    assert torch.equal(largest(keys, n, gen), expected)
