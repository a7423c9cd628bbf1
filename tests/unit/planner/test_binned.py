"""The binned access statistics against the exact ones."""

import numpy as np
import pytest

from distcache.planner.binned import BinnedProfile
from distcache.planner.stats import AccessProfile, expected_loads, expected_unique


@pytest.mark.parametrize("alpha", [0.8, 1.05, 1.3])
def test_binned_profile_matches_exact_statistics(alpha):
    rows = 100_000
    exact, binned = AccessProfile.power_law(rows, alpha), BinnedProfile.power_law(rows, alpha)
    assert binned.rows == rows and len(binned.rows_per_bin) < 2000
    for n in (1_000, 100_000):
        assert binned.unique(n) == pytest.approx(expected_unique(exact, n), rel=1e-3)
        for capacity in (rows // 100, rows // 10):
            for model in ("frequency", "lru"):
                want = expected_loads(exact, n, capacity, model)
                assert binned.loads(n, capacity, model) == pytest.approx(want, rel=2e-3)


def test_binned_profile_from_counts():
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.zipf(1.3, size=200_000) % 50_000, minlength=50_000)
    exact = AccessProfile.from_counts(counts)
    binned = BinnedProfile.from_probabilities(exact.probabilities)
    assert binned.unique(5000) == pytest.approx(expected_unique(exact, 5000), rel=1e-3)
    want = expected_loads(exact, 5000, 2000, "frequency")
    assert binned.loads(5000, 2000, "frequency") == pytest.approx(want, rel=1e-3)
