import pytest
import torch

from distcache.cache.select import largest


@pytest.mark.parametrize("m", [1, 10, 5000, 100_000])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.05, 0.3, 1.0])
def test_largest_matches_stable_sort(m, frac):
    gen = torch.Generator().manual_seed(m)
    keys = torch.randint(0, max(2, m // 10), (m,), generator=gen)  # many ties
    n = int(frac * m)
    expected = torch.argsort(keys, descending=True, stable=True)[:n]
    assert torch.equal(largest(keys, n, gen), expected)
