"""The binned access statistics against the exact ones."""

import numpy as np
import pytest

from distcache.planner.binned import (
    BinnedProfile,
    CacheShare,
    _bin_masses,
    expected_normal_max,
    shared_loads,
)
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


@pytest.mark.parametrize("alpha", [0.0, 0.9, 1.0, 1.05])
def test_power_laws_sharing_their_bins_equal_each_built_alone(alpha):
    """`BinnedProfile.power_law` takes a table's bins from the bins its alpha's power law
    shares with every other table (a prefix, the last bin cut at its rows, grown for larger
    tables): in any order of sizes, each profile is the one built from its own bins alone,
    to the bit. Sizes: the head's edge and either side of it, the first tail bin's edge, on
    and between the shared edges, and larger tables after smaller ones (the bins grow)."""
    rng = np.random.default_rng(0)
    sizes = [1, 2, 1023, 1024, 1025, 1039, 1040, 1041, 1056, 10**6, 40_000_000, 10**9]
    sizes += np.exp(rng.uniform(0, np.log(1e9), 200)).astype(int).tolist()
    for rows in rng.permutation(sizes).tolist():
        edges = BinnedProfile._edges(rows)
        counts = np.diff(edges).astype(np.float64)
        mass = _bin_masses(edges, alpha)
        alone = BinnedProfile(counts, mass / mass.sum() / counts)
        shared = BinnedProfile.power_law(rows, alpha)
        assert shared.rows == rows
        assert np.array_equal(shared.rows_per_bin, alone.rows_per_bin), rows
        assert np.array_equal(shared.probability, alone.probability), rows


@pytest.mark.parametrize("fraction", [0.01, 0.1])
def test_shared_cache_loads_match_the_exact_model(fraction):
    """One cache shared by two tables (the likeliest rows of either resident) against the same
    model on their exact per-row probabilities, table by table; one table alone:
    `BinnedProfile.loads`."""
    n, shapes = 20_000, [(100_000, 1.05), (30_000, 0.8)]
    exact = [AccessProfile.power_law(rows, alpha).probabilities for rows, alpha in shapes]
    binned = [BinnedProfile.power_law(rows, alpha) for rows, alpha in shapes]
    touch = [-np.expm1(n * np.log1p(-p)) for p in exact]
    everyone = np.concatenate(touch)
    capacity = int(fraction * everyone.size)
    resident = np.sort(everyone)[::-1][capacity - 1]  # the least likely row resident
    # every row but the `capacity` likeliest touched is loaded, each table's its own
    want = [q[q < resident].sum() for q in touch]
    shares = [CacheShare(profile=b, lookups=n) for b in binned]
    assert shared_loads(shares, capacity, "frequency") == pytest.approx(want, rel=3e-3)
    alone = binned[0].loads(n, capacity // 2, "frequency")
    assert shared_loads(shares[:1], capacity // 2, "frequency")[0] == pytest.approx(
        alone, rel=1e-12
    )
    assert shared_loads(shares, everyone.size, "frequency").tolist() == [0.0, 0.0]
    assert shared_loads(shares, everyone.size, "lru").tolist() == [0.0, 0.0]


@pytest.mark.parametrize("model", ["frequency", "lru"])
def test_a_shared_cache_of_shards_and_hot_rows_is_one_tables_cache(model):
    """A table's row-wise shard (1/S of its rows) with its hot rows replicated loads what
    `BinnedProfile.loads` of the whole table gives a cache S times as large with H more
    slots, over S (how `shards.shard_terms` prices one table's cache), exactly for the
    frequency model; for LRU, whose hot rows are then cached, not absent, within 1 %."""
    n, shards, hot, capacity = 50_000, 4, 300, 2_000
    profile = BinnedProfile.power_law(200_000, 1.05)
    want = profile.loads(n, capacity * shards + hot, model) / shards
    share = CacheShare(profile=profile, lookups=n, rows_split=shards, hot_rows=hot)
    got = shared_loads([share], capacity, model)[0]
    assert got == pytest.approx(want, rel=1e-9 if model == "frequency" else 1e-2)


def test_lru_shares_one_characteristic_time():
    """Che's approximation over two tables: one time tau for the whole cache, which the two
    tables' resident rows fill, and each table's misses at tau (a cache of several batches'
    rows: no row is touched for certain)."""
    n, capacity = 1_000, 5_000
    a, b = BinnedProfile.power_law(100_000, 1.1), BinnedProfile.power_law(50_000, 0.7)
    loads = shared_loads([CacheShare(a, n), CacheShare(b, 3 * n)], capacity, "lru")
    qa, qb = a._touch(n), b._touch(3 * n)

    def resident(tau):
        return a.rows_per_bin @ -np.expm1(tau * np.log1p(-qa)) + b.rows_per_bin @ -np.expm1(
            tau * np.log1p(-qb)
        )

    lo, hi = 0.0, 1e6  # bisect the characteristic time here, independently
    for _ in range(200):
        lo, hi = ((lo + hi) / 2, hi) if resident((lo + hi) / 2) < capacity else (lo, (lo + hi) / 2)
    want = [p.rows_per_bin @ (q * (1 - q) ** lo) for p, q in ((a, qa), (b, qb))]
    assert loads == pytest.approx(want, rel=1e-6)


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


def test_kept_answers_equal_a_fresh_profiles():
    """A profile keeps what it computed (the solver asks the same questions thousands of
    times): asked again, in any order, it answers as a profile asked once."""
    rows, alpha = 100_000, 1.1
    kept = BinnedProfile.power_law(rows, alpha)
    questions = [(300, 200.0, 2), (2000, 500.0, 8), (300, 500.0, 8), (300, 200.0, 64)]
    for hot, n, ranks in questions * 2:
        fresh = BinnedProfile.power_law(rows, alpha)
        assert kept.head_most(hot, n, ranks) == fresh.head_most(hot, n, ranks)
        assert kept.head(hot, n) == fresh.head(hot, n)
        assert kept.unique(n) == fresh.unique(n)
