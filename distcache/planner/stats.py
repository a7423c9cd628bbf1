"""Access statistics of a table and what they imply for a cache (the planner's inputs).

A table's access profile is the probability `p_r` that one lookup reads row r: from id counts
of a data sample, or a fitted power law `p_r ∝ (rank + 1)^-alpha`. From it, for batches of n
lookups (ids drawn independently, the "independent reference model"):

- `expected_unique(n) = Σ_r 1 - (1 - p_r)^n`: the rows a batch touches, i.e. the cache's
  working set per batch and the rows an all-to-all must carry (Stochastic Communication
  Avoidance's expected-communication term).
- `expected_loads(n, C, policy)`: rows loaded per batch into a cache of C rows, in steady state.
  `lru` uses Che's approximation at batch granularity: a row stays resident for the
  characteristic time τ batches with Σ_r 1 - (1 - q_r)^τ = C, where q_r = 1 - (1 - p_r)^n is
  the chance a batch touches row r, so a batch misses row r with probability q_r (1 - q_r)^τ.
  `frequency` models the look-ahead / LFU policies by their steady state with perfect
  knowledge of p: the C most likely rows stay resident and every other touched row is loaded.
  Real policies learn p from counts, which costs loads, while look-ahead's next-use knowledge
  saves some: against the simulator the model is within -11 % .. +2 % of look-ahead and
  4-14 % below LFU, the gap growing with the cache size (`benchmarks/planner_stats.py`).

Both are steady-state models: a run too short for the cache to fill is dominated by first
touches, which no model of this kind predicts (e.g. zipf(1e6, 1.2), 1.2M lookups, 10 % cache:
every policy loads the same 252 rows per batch, all first touches).

All functions are vectorized over rows (float64), chunked so that 40M-row tables fit in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distcache.errors import DistcacheConfigError

_CHUNK = 1 << 22
MODELS = ("frequency", "lru")


@dataclass(frozen=True)
class AccessProfile:
    """Per-row lookup probabilities of one table, in decreasing order (row identity is not
    needed by the model, only the distribution)."""

    probabilities: np.ndarray  # [rows] float64, sorted descending, sums to 1

    def __post_init__(self) -> None:
        p = self.probabilities
        if p.ndim != 1 or p.size == 0:
            raise DistcacheConfigError(
                f"probabilities must be a non-empty 1-D array, got shape {p.shape}"
            )
        if (p < 0).any() or not np.isclose(p.sum(), 1.0, rtol=1e-6):
            raise DistcacheConfigError(
                f"probabilities must be >= 0 and sum to 1 (sum is {p.sum():.6g})"
            )

    @property
    def rows(self) -> int:
        return self.probabilities.size

    @classmethod
    def power_law(cls, rows: int, alpha: float) -> AccessProfile:
        """p_r ∝ (r + 1)^-alpha over `rows` rows (the zipf traces' distribution)."""
        if rows < 1 or alpha < 0:
            raise DistcacheConfigError(
                f"power_law needs rows >= 1 and alpha >= 0, got {rows=}, {alpha=}"
            )
        p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
        return cls(p / p.sum())

    @classmethod
    def from_counts(
        cls, counts: Sequence[int] | np.ndarray, rows: int | None = None
    ) -> AccessProfile:
        """From id counts of a sample (rows never seen get probability 0)."""
        c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
        if rows is not None and rows > c.size:
            c = np.concatenate([c, np.zeros(rows - c.size)])
        if c.sum() <= 0:
            raise DistcacheConfigError("counts must contain at least one lookup")
        return cls(c / c.sum())

    @classmethod
    def from_ids(cls, ids: np.ndarray, rows: int) -> AccessProfile:
        """From a sample of ids in [0, rows)."""
        return cls.from_counts(np.bincount(np.asarray(ids, dtype=np.int64), minlength=rows))


def fitted_alpha(rows: int, lookups: float, seen: int, *, steps: int = 14) -> float:
    """The power law's exponent over a table's `rows` (`AccessProfile.power_law`) under which
    a sample of `lookups` lookups would see `seen` distinct rows, as a sample did (a bisection
    over [0, 3]: the expected distinct rows fall as the exponent grows). A sample that saw
    every row fits 0 (uniform); one that saw one row, 3.

    Args:
        rows: the table's rows.
        lookups: the sample's lookups of the table.
        seen: the distinct rows they read.
        steps: bisection steps (each evaluates the power law over every row: about a second
            for 40 M rows).
    """
    if lookups <= 0 or not 1 <= seen <= min(rows, lookups):
        raise DistcacheConfigError(
            f"a table's id sample must have lookups and 1 <= seen rows <= min(rows, lookups), "
            f"got {lookups=}, {seen=}, {rows=}"
        )
    low, high = 0.0, 3.0
    for _ in range(steps):
        mid = 0.5 * (low + high)
        if expected_unique(AccessProfile.power_law(rows, mid), lookups) > seen:
            low = mid  # too flat: it would see more rows than the sample did
        else:
            high = mid
    return 0.5 * (low + high)


def _touch(p: np.ndarray, n: float) -> np.ndarray:
    """q_r = 1 - (1 - p_r)^n, the chance that a batch of n lookups touches row r."""
    return -np.expm1(n * np.log1p(-np.minimum(p, 1 - 1e-16)))


def expected_unique(profile: AccessProfile, n: float) -> float:
    """Expected distinct rows in a batch of n lookups: Σ_r 1 - (1 - p_r)^n."""
    p = profile.probabilities
    return float(sum(_touch(p[i : i + _CHUNK], n).sum() for i in range(0, p.size, _CHUNK)))


def _lru_tau(q: np.ndarray, capacity: int) -> float:
    """Characteristic time τ (batches) with Σ_r 1 - (1 - q_r)^τ = capacity (bisection)."""
    if capacity >= q.size:
        return float("inf")
    lo, hi = 0.0, 1.0
    while _touch(q, hi).sum() < capacity:
        hi *= 2
        if hi > 1e15:
            return float("inf")
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _touch(q, mid).sum() < capacity:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def expected_loads(
    profile: AccessProfile, n: float, capacity: int, model: str = "frequency"
) -> float:
    """Expected rows loaded per batch of n lookups into a cache of `capacity` rows, in steady
    state, under `model` ('frequency' for look-ahead/LFU, 'lru')."""
    if model not in MODELS:
        raise DistcacheConfigError(f"unknown model {model!r}: expected one of {MODELS}")
    if capacity < 0:
        raise DistcacheConfigError(f"capacity must be >= 0, got {capacity}")
    q = _touch(profile.probabilities, n)  # [rows]
    if capacity >= q.size:
        return 0.0
    if model == "frequency":
        return float(q[capacity:].sum())  # the C likeliest rows stay, the rest are loaded
    tau = _lru_tau(q, capacity)
    return float((q * np.exp(tau * np.log1p(-np.minimum(q, 1 - 1e-16)))).sum())
