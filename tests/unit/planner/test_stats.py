"""The access-statistics model against the trace simulator (the reference)."""

import numpy as np
import pytest

from distcache.cache.simulate import simulate
from distcache.data.traces import zipf_trace
from distcache.planner import AccessProfile, expected_loads, expected_unique

ROWS, ALPHA, BATCH = 20_000, 1.05, 512


@pytest.fixture(scope="module")
def trace():
    return list(zipf_trace(rows=ROWS, alpha=ALPHA, batch=BATCH, batches=240, seed=0))


def _steady_loads(batches, capacity, policy, warm=80):
    full = simulate(batches, num_rows=ROWS, capacity=capacity, policy=policy)
    head = simulate(batches[:warm], num_rows=ROWS, capacity=capacity, policy=policy)
    return (full.loads - head.loads) / (len(batches) - warm)


def test_expected_unique_matches_traces(trace):
    model = expected_unique(AccessProfile.power_law(ROWS, ALPHA), BATCH)
    measured = np.mean([b.unique().numel() for b in trace])
    assert model == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("capacity", [1000, 4000])
def test_lru_model_matches_the_simulator(trace, capacity):
    model = expected_loads(AccessProfile.power_law(ROWS, ALPHA), BATCH, capacity, "lru")
    assert model == pytest.approx(_steady_loads(trace, capacity, "lru"), rel=0.03)


@pytest.mark.parametrize("capacity", [1000, 4000])
def test_frequency_model_approximates_lookahead(trace, capacity):
    """At the default window (L = 64) look-ahead loads 9-16 % less than perfect-frequency
    caching (it also knows the next 64 batches): the model is conservative within 20 %."""
    model = expected_loads(AccessProfile.power_law(ROWS, ALPHA), BATCH, capacity, "frequency")
    measured = _steady_loads(trace, capacity, "lookahead")  # simulate's L: the config default
    assert measured <= model <= 1.2 * measured


def test_profiles_and_edges():
    counts = np.array([5, 0, 3, 2])
    profile = AccessProfile.from_counts(counts)
    assert np.allclose(profile.probabilities, [0.5, 0.3, 0.2, 0.0])
    assert AccessProfile.from_ids(np.array([1, 1, 2]), rows=5).rows == 5
    assert expected_unique(profile, 1) == pytest.approx(1.0)
    assert expected_loads(profile, 10, capacity=4) == 0.0
    with pytest.raises(ValueError, match="sum to 1"):
        AccessProfile(np.array([0.5, 0.2]))
    with pytest.raises(ValueError, match="unknown model 'fifo'"):
        expected_loads(profile, 10, 2, "fifo")
    with pytest.raises(ValueError, match="at least one lookup"):
        AccessProfile.from_counts([0, 0])


@pytest.mark.parametrize(("rows", "alpha"), [(200_000, 1.05), (1_000_000, 0.9), (50_000, 1.3)])
def test_a_power_law_fitted_to_a_sample_prices_a_cache_as_the_truth(rows, alpha):
    """`fitted_alpha` against the distribution the sample is drawn from: the exponent, and
    the loads of a 5 % cache it implies; the sample's raw counts, as a profile, promise a
    quarter to all of the loads fewer (the rows they never saw never miss)."""
    from distcache.planner.stats import fitted_alpha

    truth = AccessProfile.power_law(rows, alpha)
    sample = np.random.default_rng(0).choice(rows, size=65_536, p=truth.probabilities)
    counts = np.bincount(sample, minlength=rows)
    fitted = fitted_alpha(rows, counts.sum(), int((counts > 0).sum()))
    assert fitted == pytest.approx(alpha, abs=0.02)
    batch, capacity = 2048, rows // 20
    true_loads = expected_loads(truth, batch, capacity)
    ours = expected_loads(AccessProfile.power_law(rows, fitted), batch, capacity)
    raw = expected_loads(AccessProfile.from_counts(counts), batch, capacity)
    assert ours == pytest.approx(true_loads, rel=0.1)
    assert raw < 0.8 * true_loads


def test_fitted_alpha_edges():
    from distcache.errors import DistcacheConfigError
    from distcache.planner.stats import fitted_alpha

    assert fitted_alpha(100, 5000, 100) < 0.05  # every row seen: uniform
    assert fitted_alpha(1000, 1000, 1) > 2.9  # one row seen
    for bad in ((5, 0, 0), (5, 10, 6), (5, 3, 4)):
        with pytest.raises(DistcacheConfigError, match="seen rows <= min"):
            fitted_alpha(*bad)
