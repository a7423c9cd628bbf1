"""Access statistics on a binned profile: `stats.py`'s expected unique rows and cache loads
of a table, in a few thousand operations however many rows it has.

The likeliest rows get a bin each, the tail geometric bins of rows of near-equal probability
(`BinnedProfile`); a power law is binned analytically, with no per-row array. The binned
functions agree with the exact `AccessProfile` ones to well under 1 %
(tests/unit/planner/test_binned.py).

Example::

    access = table_access(TableStats(name="t0", rows=40_000_000, dim=128))
    rows_touched = access.unique(65536)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distcache.errors import DistcacheConfigError
from distcache.planner.stats import AccessProfile
from distcache.planner.types import TableStats

_HEAD_ROWS = 1024  # the likeliest rows, one bin each
_BIN_GROWTH = 1 / 64  # beyond the head, a bin spans rows [k, k·(1 + growth)) of the ranking


class BinnedProfile:
    """A table's sorted access profile with the tail in geometric bins of rows.

    Within a bin the probabilities differ by at most a factor (1 + 1/64)^alpha, so the bin's
    mean stands for each of its rows; a power law is binned analytically (no per-row array).
    Results are memoized per (n, capacity, model).

    Args:
        rows_per_bin: rows in each bin, most likely bin first.
        probability: the mean lookup probability of one row of each bin.
    """

    def __init__(self, rows_per_bin: np.ndarray, probability: np.ndarray):
        self.rows_per_bin = np.asarray(rows_per_bin, dtype=np.float64)  # [bins]
        self.probability = np.asarray(probability, dtype=np.float64)  # [bins]
        self.rows_through = np.cumsum(self.rows_per_bin)  # [bins] rows up to each bin's end
        self.rows = int(round(self.rows_through[-1]))
        self._memo: dict[tuple | str, float | np.ndarray] = {}

    @staticmethod
    def _edges(rows: int) -> np.ndarray:
        """Bin boundaries over ranks [0, rows): 0, 1, .., head, then geometric."""
        head = np.arange(min(rows, _HEAD_ROWS) + 1, dtype=np.int64)
        if rows <= _HEAD_ROWS:
            return head
        steps = math.ceil(math.log(rows / _HEAD_ROWS) / math.log1p(_BIN_GROWTH)) + 1
        # Strictly increasing (each step adds >= head * growth = 16 rows) until clipped.
        tail = np.floor(_HEAD_ROWS * (1 + _BIN_GROWTH) ** np.arange(1, steps + 1)).astype(np.int64)
        return np.concatenate([head, tail[tail < rows], [rows]])

    @classmethod
    def power_law(cls, rows: int, alpha: float) -> BinnedProfile:
        """p ∝ (rank + 1)^-alpha; tail bins integrate x^-alpha over [lo + 1/2, hi + 1/2].

        Every table's bins but its last are a prefix of the same bins (`_edges`), whose
        masses are made once per alpha (`_PowerLawBins`): a table's profile costs a few
        slices, not the integrals of its ~700 bins again (a thousand-table plan builds a
        thousand)."""
        edges, mass = _power_law_bins(float(alpha)).of(rows)
        counts = np.diff(edges).astype(np.float64)
        return cls(counts, mass / mass.sum() / counts)

    @classmethod
    def from_probabilities(cls, probabilities: np.ndarray) -> BinnedProfile:
        """From per-row probabilities sorted in decreasing order (an `AccessProfile`'s)."""
        p = np.asarray(probabilities, dtype=np.float64)
        edges = cls._edges(p.size)
        counts = np.diff(edges).astype(np.float64)
        return cls(counts, np.add.reduceat(p, edges[:-1]) / counts)

    def _touch(self, n: float) -> np.ndarray:
        """q = 1 - (1 - p)^n per bin: the chance a batch of n lookups touches one row."""
        key = ("q", float(n))
        if key not in self._memo:
            if "keep" not in self._memo:  # log(1 - p) per bin, the same for every n
                self._memo["keep"] = np.log1p(-np.minimum(self.probability, 1 - 1e-16))
            self._memo[key] = -np.expm1(n * self._memo["keep"])
        return self._memo[key]

    def unique(self, n: float) -> float:
        """Expected distinct rows in n lookups (`stats.expected_unique`)."""
        key = ("u", float(n))
        if key not in self._memo:
            self._memo[key] = float(self.rows_per_bin @ self._touch(n))
        return self._memo[key]

    def loads(self, n: float, capacity: int, model: str = "frequency") -> float:
        """Expected rows loaded per batch into a cache of `capacity` rows
        (`stats.expected_loads`)."""
        key = ("l", float(n), int(capacity), model)
        if key in self._memo:
            return self._memo[key]
        if capacity >= self.rows:
            value = 0.0
        elif model == "frequency":
            q = self._touch(n)
            k = int(np.searchsorted(self.rows_through, capacity, side="right"))
            rest = self.rows_per_bin[k + 1 :] @ q[k + 1 :]
            value = float((self.rows_through[k] - capacity) * q[k] + rest)
        elif model == "lru":
            value = self._lru_loads(self._touch(n), capacity)
        else:
            raise DistcacheConfigError(f"unknown model {model!r}: expected 'frequency' or 'lru'")
        self._memo[key] = value
        return value

    def head(self, rows: int, n: float = 0.0) -> tuple[float, float]:
        """(lookup mass, expected distinct rows in n lookups) of the `rows` likeliest rows: the
        share of lookups a replica of them serves, and the rows of it a batch touches."""
        key = ("h", int(rows), float(n))
        if key not in self._memo:
            touched = self._head_sum(rows, ("q", float(n)), self._touch(n), self._head_bin(rows))
            self._memo[key] = (self.head_mass(rows), touched)
        return self._memo[key]

    def head_mass(self, rows: int) -> float:
        """`head(rows)[0]`: the lookup mass of the `rows` likeliest rows (without the rows a
        batch touches, which a caller of the mass alone does not need)."""
        key = ("hm", int(rows))
        if key not in self._memo:
            self._memo[key] = self._head_sum(rows, "p", self.probability, self._head_bin(rows))
        return self._memo[key]

    def head_most(self, rows: int, n: float, batches: int) -> float:
        """The expected most distinct rows among the `rows` likeliest that any of `batches`
        independent batches of n lookups touches (what a rank sends when every rank sends as
        many as the busiest: `sharding.hot_reduce`): the mean `head(rows, n)[1]` plus its
        standard deviation (rows touched independently, each with its q) times the expected
        maximum of `batches` standard normals; at most `rows` and n."""
        key = ("most", int(rows), float(n), int(batches))
        if key in self._memo:
            return self._memo[key]
        mean = self.head(rows, n)[1]
        if batches <= 1 or mean <= 0:
            return mean
        spread = ("v", float(n))  # each row's variance of being touched
        if spread not in self._memo:
            q = self._touch(n)
            self._memo[spread] = q * (1 - q)
        variance = self._head_sum(rows, spread, self._memo[spread])
        rows = min(max(int(rows), 0), self.rows)
        most = min(mean + math.sqrt(variance) * expected_normal_max(batches), rows, n)
        self._memo[key] = most
        return most

    def _head_bin(self, rows: int) -> int:
        """The bin holding the last of the `rows` likeliest rows."""
        key = ("b", int(rows))
        if key not in self._memo:
            rows = min(max(int(rows), 0), self.rows)
            self._memo[key] = int(np.searchsorted(self.rows_through, rows, side="left"))
        return self._memo[key]

    def _head_sum(
        self, rows: int, name: tuple | str, per_row: np.ndarray, k: int | None = None
    ) -> float:
        """The sum over the `rows` likeliest rows of a value given per row of each bin
        (`per_row` `[bins]`, memoized as `name`): the bins wholly inside the head, from the
        value's running sum over the bins (made once per value), then the head's rows of the
        bin holding its last rows (bin `k`, `_head_bin`)."""
        rows = min(max(int(rows), 0), self.rows)
        k = self._head_bin(rows) if k is None else k
        inside = rows - (self.rows_through[k - 1] if k else 0.0)
        whole = float(self._through(name, per_row)[k - 1]) if k else 0.0
        return whole + (inside * per_row[k] if k < per_row.size else 0.0)

    def _through(self, name: tuple | str, per_row: np.ndarray) -> np.ndarray:
        """`[bins]` the sum of `per_row` (memoized as `name`) over the rows up to each bin's
        end."""
        key = ("through", name)
        if key not in self._memo:
            self._memo[key] = np.cumsum(self.rows_per_bin * per_row)
        return self._memo[key]

    def rows_for_mass(self, mass: float) -> int:
        """The fewest likeliest rows that take at least `mass` of the lookups (all rows for
        a mass of 1 or more)."""
        key = ("m", float(mass))
        if key in self._memo:
            return self._memo[key]
        through = self._through("p", self.probability)  # mass up to each bin's end
        k = int(np.searchsorted(through, mass - 1e-12, side="left"))
        if k >= through.size:
            self._memo[key] = self.rows
            return self.rows
        before = through[k - 1] if k else 0.0
        start = self.rows_through[k - 1] if k else 0.0
        need = math.ceil((mass - before) / self.probability[k] - 1e-9) if self.probability[k] else 0
        self._memo[key] = int(min(self.rows, start + max(need, 0)))
        return self._memo[key]

    def _lru_loads(self, q: np.ndarray, capacity: int) -> float:
        """Che's approximation: τ with Σ rows·(1 - (1-q)^τ) = capacity; misses q·(1-q)^τ."""
        log_keep = np.log1p(-np.minimum(q, 1 - 1e-16))
        tau = _che_time(self.rows_per_bin, log_keep, capacity)
        if math.isinf(tau):
            return 0.0
        return float(self.rows_per_bin @ (q * np.exp(tau * log_keep)))


def _bin_masses(edges: np.ndarray, alpha: float) -> np.ndarray:
    """The unnormalized mass of each bin between `edges` (`BinnedProfile._edges`): a head
    rank's (rank + 1)^-alpha, then each tail bin's `_tail_masses`."""
    head = edges[edges <= _HEAD_ROWS][1:].astype(np.float64)  # 1-based ranks 1..head
    tail = _tail_masses(edges[len(head) : -1], edges[len(head) + 1 :], alpha)
    return np.concatenate([head**-alpha, tail])


def _tail_masses(lo: np.ndarray, hi: np.ndarray, alpha: float) -> np.ndarray:
    """The integral of x^-alpha over [lo + 1/2, hi + 1/2] for the ranks [lo, hi) of each bin."""
    lo, hi = lo + 0.5, hi + 0.5
    beta = 1.0 - alpha
    log_lo, log_ratio = np.log(lo), np.log(hi / lo)
    if abs(beta) < 1e-12:
        return log_ratio
    # lo^beta · (exp(beta · ln(hi/lo)) - 1) / beta, stable near alpha = 1
    return np.exp(beta * log_lo) * np.expm1(beta * log_ratio) / beta


class _PowerLawBins:
    """The bins of one alpha's power law over as many rows as asked so far: every table's
    `BinnedProfile._edges` but the last are a prefix of the same edges (the head's ranks, then
    the geometric ones below its rows), so their masses are the same; only the last bin, cut at
    the table's rows, is its own."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        # ([bins + 1] edges, [bins] masses), grown by `of`: replaced together, in one
        # assignment, so that a thread reading them never sees the edges of one and the
        # masses of the other.
        self.bins = (np.zeros(1, dtype=np.int64), np.zeros(0))

    def of(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(`BinnedProfile._edges(rows)`, the unnormalized mass of each of its bins)."""
        shared, mass = self.bins
        if rows > shared[-1]:  # grown to twice the rows asked: a few growths in all
            shared = BinnedProfile._edges(2 * rows)
            mass = _bin_masses(shared, self.alpha)
            self.bins = shared, mass
        k = int(np.searchsorted(shared, rows, side="left"))  # shared[k - 1] < rows
        if shared[k] == rows:  # an edge of the shared bins: a prefix
            return shared[: k + 1], mass[:k]
        edges = np.append(shared[:k], rows)  # the last bin cut at the table's rows
        last = _tail_masses(edges[-2:-1].astype(np.float64), np.array([float(rows)]), self.alpha)
        return edges, np.concatenate([mass[: k - 1], last])


@functools.lru_cache(maxsize=64)
def _power_law_bins(alpha: float) -> _PowerLawBins:
    """The shared bins of `alpha`'s power law (the few alphas of a workload each kept)."""
    return _PowerLawBins(alpha)


@dataclass(frozen=True)
class CacheShare:
    """One table's part of a cache shared by several (`shared_loads`)."""

    profile: BinnedProfile
    """The table's access profile."""
    lookups: float
    """n: the table's lookups per batch (all its shards')."""
    rows_split: int = 1
    """The cache holds one of this many row-wise shards of the table, each 1/rows_split of
    every bin's rows (hashed ids spread evenly), touched with the table's q."""
    hot_rows: int = 0
    """The table's likeliest rows, replicated outside the cache: they never reach it."""

    def bins(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows of each bin that reach the cache, q of each bin): `[bins]` each."""
        profile = self.profile
        rows = profile.rows_per_bin
        if self.hot_rows:
            rows = np.clip(profile.rows_through - self.hot_rows, 0.0, rows)
        return rows / self.rows_split, profile._touch(self.lookups)


def shared_loads(shares: Sequence[CacheShare], capacity: float, model: str) -> np.ndarray:
    """[len(shares)] expected rows of each table loaded per batch into one cache of `capacity`
    rows shared by `shares`, as `BinnedProfile.loads` prices one table's cache.

    'frequency': the `capacity` likeliest rows of all the tables together stay resident, and
    every other touched row is loaded (each table's share is exact: its touched rows outside
    them). 'lru': Che's approximation over all their rows, one characteristic time for the
    whole cache (each table's share: its rows' misses). With one table of `rows_split` 1 and
    no hot rows, the sum is `BinnedProfile.loads(lookups, capacity, model)`.
    """
    rows, q = (np.concatenate(x) for x in zip(*(s.bins() for s in shares), strict=True))
    owner = np.repeat(np.arange(len(shares)), [s.profile.rows_per_bin.size for s in shares])
    if model == "frequency":
        loaded = _frequency_misses(rows, q, capacity)
    elif model == "lru":
        loaded = _lru_misses(rows, q, capacity)
    else:
        raise DistcacheConfigError(f"unknown model {model!r}: expected 'frequency' or 'lru'")
    return np.bincount(owner, weights=loaded, minlength=len(shares))


def _frequency_misses(rows: np.ndarray, q: np.ndarray, capacity: float) -> np.ndarray:
    """Per bin `[bins]`, rows loaded per batch when the `capacity` likeliest rows of all the
    bins stay resident: every touched row outside them."""
    order = np.argsort(-q, kind="stable")
    through = np.cumsum(rows[order])  # rows up to each bin's end, likeliest first
    outside = np.empty_like(rows)
    outside[order] = np.clip(through - capacity, 0.0, rows[order])
    return outside * q


def _lru_misses(rows: np.ndarray, q: np.ndarray, capacity: float) -> np.ndarray:
    """Per bin `[bins]`, rows loaded per batch by an LRU cache of `capacity` rows over all
    the bins (Che's approximation, `BinnedProfile._lru_loads`)."""
    log_keep = np.log1p(-np.minimum(q, 1 - 1e-16))
    tau = _che_time(rows, log_keep, capacity) if capacity < rows.sum() else math.inf
    if math.isinf(tau):  # the rows never fill the cache: nothing is evicted
        return np.zeros_like(rows)
    return rows * q * np.exp(tau * log_keep)


def _che_time(rows: np.ndarray, log_keep: np.ndarray, capacity: float) -> float:
    """Che's characteristic time τ (batches): Σ rows·(1 - (1-q)^τ) = capacity, for
    log_keep = log(1 - q) per bin; inf when the rows never fill the cache."""

    def resident(tau: float) -> float:
        return float(rows @ -np.expm1(tau * log_keep))

    lo, hi = 0.0, 1.0
    while resident(hi) < capacity:
        lo, hi = hi, hi * 2
        if hi > 1e15:
            return math.inf
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if resident(mid) < capacity else (lo, mid)
        if hi - lo <= 1e-9 * hi:
            break
    return 0.5 * (lo + hi)


_PROFILES: dict[tuple, tuple[object, BinnedProfile]] = {}
_PROFILE_CACHE_SIZE = 4096


_NORMAL_MAX: dict[int, float] = {}


def expected_normal_max(count: int) -> float:
    """E[max of `count` independent standard normals] (0 for one; 0.564 for two, 2.41 for
    64), by quadrature of x · d/dx Φ(x)^count."""
    if count <= 1:
        return 0.0
    if count not in _NORMAL_MAX:
        x = np.linspace(-10.0, 10.0, 20001)
        cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
        density = np.exp(-0.5 * x**2) / math.sqrt(2.0 * math.pi)
        integrand = x * count * density * cdf ** (count - 1)
        _NORMAL_MAX[count] = float(np.sum(integrand) * (x[1] - x[0]))
    return _NORMAL_MAX[count]


def table_access(table: TableStats) -> BinnedProfile:
    """The binned access profile of `table`, built once per (rows, alpha) or counts array."""
    if table.counts is None:
        key: tuple = ("power_law", table.rows, float(table.alpha))
    else:  # the cache holds the array, so its id cannot be reused while the entry lives
        key = ("counts", table.rows, id(table.counts))
    if key not in _PROFILES:
        if len(_PROFILES) >= _PROFILE_CACHE_SIZE:
            _PROFILES.clear()
        if table.counts is None:
            profile = BinnedProfile.power_law(table.rows, float(table.alpha))
        else:
            exact = AccessProfile.from_counts(table.counts, rows=table.rows)
            profile = BinnedProfile.from_probabilities(exact.probabilities)
        _PROFILES[key] = (table.counts, profile)
    return _PROFILES[key][1]
