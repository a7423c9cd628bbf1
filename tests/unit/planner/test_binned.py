"""The binned access statistics against the exact ones."""

import numpy as np
import pytest

from distcache.planner.binned import BinnedProfile, expected_normal_max, shared_loads
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


@pytest.mark.parametrize("fraction", [0.01, 0.1])
def test_shared_cache_loads_match_the_exact_model(fraction):
    """One cache shared by two tables (the likeliest rows of either resident) against the same
    model on their exact per-row probabilities; one table alone: `BinnedProfile.loads`."""
    n, shapes = 20_000, [(100_000, 1.05), (30_000, 0.8)]
    exact = [AccessProfile.power_law(rows, alpha).probabilities for rows, alpha in shapes]
    binned = [BinnedProfile.power_law(rows, alpha) for rows, alpha in shapes]
    touch = np.sort(np.concatenate([-np.expm1(n * np.log1p(-p)) for p in exact]))[::-1]
    capacity = int(fraction * touch.size)
    want = touch[capacity:].sum()  # every row but the `capacity` likeliest touched is loaded
    assert shared_loads(binned, n, capacity) == pytest.approx(want, rel=2e-3)
    alone = binned[0].loads(n, capacity // 2, "frequency")
    assert shared_loads(binned[:1], n, capacity // 2) == pytest.approx(alone, rel=1e-12)
    assert shared_loads(binned, n, touch.size) == 0.0


def test_binned_profile_from_counts():
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.zipf(1.3, size=200_000) % 50_000, minlength=50_000)
    exact = AccessProfile.from_counts(counts)
    binned = BinnedProfile.from_probabilities(exact.probabilities)
    assert binned.unique(5000) == pytest.approx(expected_unique(exact, 5000), rel=1e-3)
    want = expected_loads(exact, 5000, 2000, "frequency")
    assert binned.loads(5000, 2000, "frequency") == pytest.approx(want, rel=1e-3)


def test_expected_normal_maximum_matches_known_values():
    assert expected_normal_max(1) == 0.0
    assert expected_normal_max(2) == pytest.approx(1 / np.sqrt(np.pi), rel=1e-6)
    assert expected_normal_max(3) == pytest.approx(1.5 / np.sqrt(np.pi), rel=1e-6)
    assert expected_normal_max(64) == pytest.approx(2.3437, abs=1e-3)


@pytest.mark.parametrize(("hot", "n", "ranks"), [(300, 200, 2), (2000, 500, 8), (50, 1000, 64)])
def test_most_touched_hot_rows_match_a_simulation(hot, n, ranks):
    """`head_most` (what a 'touched' replica's all-gather sends: the most rows any rank's batch
    touches) against sampled batches of a power law: within 2 % of the simulated mean of the
    maximum over `ranks` batches."""
    rows, alpha = 100_000, 1.1
    exact = AccessProfile.power_law(rows, alpha)
    binned = BinnedProfile.power_law(rows, alpha)
    rng = np.random.default_rng(0)
    trials = 100
    cdf = np.cumsum(exact.probabilities)
    draws = np.searchsorted(cdf, rng.random((trials, ranks, n)) * cdf[-1])  # [T, W, n] rows
    batch = np.broadcast_to(np.arange(trials * ranks).reshape(trials, ranks, 1), draws.shape)
    seen = np.zeros((trials * ranks, hot), dtype=bool)
    mine = draws < hot
    seen[batch[mine], draws[mine]] = True
    touched = seen.sum(axis=1).reshape(trials, ranks).astype(np.float64)  # distinct hot rows
    assert binned.head_most(hot, n, ranks) == pytest.approx(touched.max(axis=1).mean(), rel=0.02)
    assert binned.head_most(hot, n, 1) == pytest.approx(binned.head(hot, n)[1])
