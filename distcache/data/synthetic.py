"""Synthetic click logs: Criteo-shaped training batches with power-law ids and learnable labels.

`SyntheticClickLog` stands in for Criteo when the data is not at hand (tests, benchmarks,
multi-rank smoke runs): the same batch layout, tables of the same sizes (`synthetic_preset`),
a power-law popularity per table, and labels drawn from a hidden logistic model of the
features, so a model trained on it has something to learn.

Everything is a pure function of (seed, global batch index): no table of per-row weights or
probabilities is stored, so 40M-row tables cost nothing but their ids.

- Ids: popularity rank r is drawn with probability close to (r + 1)^-alpha (a vectorized inverse
  CDF: rank 0 exactly, rank k >= 1 the mass of [k + 0.5, k + 1.5) of the continuous law), then
  with `hash_ids` mapped to row `(a * r + b) mod rows` (a coprime with rows, fixed per seed and
  table), so hot rows are spread over the id space as hashed real ids are.
- Labels: `logit = sum_t s * mean(w_t(id) over the bag) + c . (dense - mean) + bias` with
  `w_t(id)` in [-1, 1) a hash of (seed, table, id), then `label ~ Bernoulli(sigmoid(logit))`.
  `SyntheticClickLog.hidden_logit` recomputes the logit of any batch.
- Weights (`weighted`): each id gets a weight in (0, 1], as weighted features (scores of a
  user's history) carry, drawn from a stream of their own: the ids and labels are those of the
  unweighted log.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from distcache.data.criteo import (
    CRITEO_KAGGLE_TABLE_SIZES,
    CRITEO_TERABYTE_TABLE_SIZES,
    INT_FEATURE_COUNT,
    feature_names,
)
from distcache.errors import DistcacheConfigError

if TYPE_CHECKING:  # TorchRec loads with the first batch: a preset's check stays light
    from torchrec.datasets.utils import Batch

__all__ = ["SYNTHETIC_PRESETS", "SyntheticClickLog", "SyntheticConfig", "synthetic_preset"]

MAX_TABLE_ROWS = 1 << 31
"""Largest table: the affine id map multiplies two ids below this in int64."""
MAX_ALPHA = 10.0

SYNTHETIC_PRESETS: dict[str, tuple[int, ...]] = {
    "criteo-kaggle": CRITEO_KAGGLE_TABLE_SIZES,
    "criteo-terabyte": CRITEO_TERABYTE_TABLE_SIZES,
    "tiny": (100, 1_000, 5_000, 20_000, 50, 10_000, 3, 100_000),
}
"""Table sizes by preset name; see `synthetic_preset` for the spec syntax."""

_PRESET_KEYS = {
    "scale": int, "alpha": float, "pooling": int, "variable_pooling": bool,
    "dense_features": int, "batch_size": int, "num_batches": int, "seed": int, "hash_ids": bool,
    "weighted": bool,
}  # fmt: skip
_SPARSE_STD = 1.5  # std of the sparse part of the hidden logit (fixed pooling 1)
_DENSE_NORM = 1.0  # L2 norm of the hidden dense coefficients
_LABEL_BIAS = -1.0  # a click-through rate near 0.3
_GOMPERTZ = 0.5963473623231940  # E[log(1 + X)] for X ~ Exp(1): the mean of each dense feature
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _fail(message: str) -> NoReturn:
    raise DistcacheConfigError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """A synthetic click log: its tables, id popularity, bag sizes and batches.

    Example::

        config = SyntheticConfig(table_sizes=(1000, 40_000_000), alpha=(1.1, 1.05), batch_size=256)
    """

    table_sizes: tuple[int, ...]
    """Rows per table, each in [1, 2**31]; sparse feature i reads table i."""
    alpha: float | tuple[float, ...] = 1.05
    """Power-law exponent in [0, 10] (0: uniform), one for all tables or one per table."""
    pooling: int = 1
    """Ids per bag (1, as in Criteo); with `variable_pooling` the largest bag."""
    variable_pooling: bool = False
    """Bag sizes drawn uniformly from 0..pooling, empty bags included."""
    dense_features: int = INT_FEATURE_COUNT
    batch_size: int = 512
    """Samples per batch on each rank."""
    num_batches: int = 100
    """Batches per rank."""
    seed: int = 0
    hash_ids: bool = True
    """Spread hot rows over the id space (else row r is the r-th most popular)."""
    weighted: bool = False
    """Give every id a weight in (0, 1] (weighted features)."""

    def __post_init__(self) -> None:
        sizes = self.table_sizes
        if isinstance(sizes, int) or not all(_is_int(r) for r in sizes):
            _fail(f"table_sizes must be a sequence of ints, got {sizes!r}")
        object.__setattr__(self, "table_sizes", tuple(int(r) for r in sizes))
        if not self.table_sizes:
            _fail("table_sizes must name at least one table")
        for i, rows in enumerate(self.table_sizes):
            if not 1 <= rows <= MAX_TABLE_ROWS:
                _fail(f"table_sizes[{i}] must be in [1, {MAX_TABLE_ROWS}], got {rows}")
        alpha = self.alpha
        if isinstance(alpha, Sequence) and not isinstance(alpha, str):
            if not all(isinstance(a, int | float) for a in alpha):
                _fail(f"alpha must be a float or a sequence of floats, got {alpha!r}")
            object.__setattr__(self, "alpha", tuple(float(a) for a in alpha))
            if len(self.alpha) != len(self.table_sizes):
                _fail(f"alpha holds {len(self.alpha)} exponents for {len(sizes)} tables")
        elif not isinstance(alpha, int | float) or isinstance(alpha, bool):
            _fail(f"alpha must be a float or a sequence of floats, got {alpha!r}")
        for a in self.alphas:
            if not 0.0 <= a <= MAX_ALPHA:
                _fail(f"alpha must be in [0, {MAX_ALPHA}], got {a}")
        for name, low in (("pooling", 1), ("dense_features", 1), ("batch_size", 1),
                          ("num_batches", 1), ("seed", 0)):  # fmt: skip
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                _fail(f"{name} must be an int >= {low}, got {value!r}")

    @property
    def alphas(self) -> tuple[float, ...]:
        """The exponent of each table."""
        if isinstance(self.alpha, tuple):
            return self.alpha
        return (float(self.alpha),) * len(self.table_sizes)

    @property
    def feature_names(self) -> list[str]:
        """KeyedJaggedTensor keys, one per table: f0, f1, ... (as `distcache.job.dlrm`)."""
        return feature_names(len(self.table_sizes))


def synthetic_preset(spec: str) -> SyntheticConfig:
    """A `SyntheticConfig` from a preset spec `NAME[:key=value,...]`.

    Names are the keys of `SYNTHETIC_PRESETS` (`criteo-kaggle`, `criteo-terabyte`, `tiny`).
    Keys are `scale` (divide every table's rows, keeping at least 1) and the fields of
    `SyntheticConfig` but `table_sizes` (alpha: one float; booleans: true/false).

    Args:
        spec: e.g. 'criteo-terabyte:scale=1000,batch_size=256,seed=3'.

    Example::

        config = synthetic_preset("criteo-kaggle:scale=100,alpha=1.1")
    """
    name, _, rest = spec.strip().partition(":")
    if name not in SYNTHETIC_PRESETS:
        _fail(f"unknown synthetic preset {name!r}; allowed: {sorted(SYNTHETIC_PRESETS)}")
    params = _parse_params(name, rest)
    scale = params.pop("scale", 1)
    if scale < 1:
        _fail(f"synthetic preset {name}: scale must be >= 1, got {scale}")
    sizes = tuple(max(1, rows // scale) for rows in SYNTHETIC_PRESETS[name])
    return SyntheticConfig(table_sizes=sizes, **params)


def _parse_value(where: str, key: str, text: str) -> object:
    """`text` as the type of preset key `key`; ints may be written 1e3."""
    kind = _PRESET_KEYS[key]
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            _fail(f"{where}: {key} must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (kind is int and not value.is_integer()):
        _fail(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {text!r}")
    return int(value) if kind is int else value


def _parse_params(name: str, text: str) -> dict[str, object]:
    """'k1=v1,k2=v2' as typed values; unknown, repeated or malformed keys are errors."""
    where, params = f"synthetic preset {name}", {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not value:
            _fail(f"{where}: expected key=value, got {item!r}")
        if key not in _PRESET_KEYS:
            _fail(f"{where}: unknown key {key!r}; allowed: {sorted(_PRESET_KEYS)}")
        if key in params:
            _fail(f"{where}: key {key!r} given twice")
        params[key] = _parse_value(where, key, value)
    return params


def _affine_map(rows: int, seed: int, table: int) -> tuple[int, int]:
    """(a, b) of the bijection r -> (a * r + b) mod rows: a coprime with rows, fixed per seed."""
    if rows == 1:
        return 1, 0
    rng = np.random.default_rng([seed, table, 0xA5F1E])
    a, b = int(rng.integers(1, rows)), int(rng.integers(rows))
    while math.gcd(a, rows) != 1:
        a = a % (rows - 1) + 1
    return a, b


def _uniform_hash(seed: int, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """A pseudo-random float64 in [-1, 1) per (seed, table, id), splitmix64-mixed."""
    salt = np.uint64(seed * int(_MIX1) % 2**64)  # Python ints: no numpy scalar overflow
    z = ids.astype(np.uint64) * _GOLDEN  # arrays wrap modulo 2^64 silently
    z += (tables.astype(np.uint64) + np.uint64(1)) * _MIX2 + salt
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0


class SyntheticClickLog(IterableDataset):
    """Batches of a synthetic click log, for one rank of `world_size`.

    Local batch i of rank r is global batch `i * world_size + r`, a pure function of
    (seed, global index): each rank draws its own part, the union over ranks does not depend on
    the number of ranks, and a resumed run starts at any batch with `iter_from(i)`. Under a
    `DataLoader` (batch_size=None) with workers, worker w yields every num_workers-th batch, so
    the loader's round-robin keeps the order.

    Args:
        config: The log's tables, popularity and batch shape.
        rank: This rank, in [0, world_size).
        world_size: Ranks drawing from the log.

    Example::

        log = SyntheticClickLog(synthetic_preset("criteo-kaggle:scale=100"), rank=0, world_size=2)
        for batch in log.iter_from(10):  # resume at local batch 10
            ...
    """

    def __init__(self, config: SyntheticConfig, *, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        if not (_is_int(world_size) and world_size >= 1):
            _fail(f"world_size must be an int >= 1, got {world_size!r}")
        if not (_is_int(rank) and 0 <= rank < world_size):
            _fail(f"rank must be an int in [0, {world_size}), got {rank!r}")
        self.config, self.rank, self.world_size = config, rank, world_size
        rows = np.array(config.table_sizes, dtype=np.int64)  # [T]
        alpha = np.array(config.alphas, dtype=np.float64)  # [T]
        self._rows = rows
        self._e = 1.0 - alpha  # [T]: exponent of the antiderivative of x^-alpha
        self._near_one = np.abs(self._e) < 1e-6  # [T]: use the log form of alpha == 1
        e = np.where(self._near_one, 1.0, self._e)
        hi = rows + 0.5
        tail = np.where(self._near_one, np.log(hi / 1.5), (hi**e - 1.5**e) / e)  # ∫ x^-a
        self._p0 = 1.0 / (1.0 + np.maximum(tail, 0.0))  # [T]: probability of rank 0
        maps = [_affine_map(int(r), config.seed, t) for t, r in enumerate(config.table_sizes)]
        self._a = np.array([m[0] for m in maps], dtype=np.int64)  # [T]
        self._b = np.array([m[1] for m in maps], dtype=np.int64)  # [T]
        coef = np.random.default_rng([config.seed, 0xDE115E]).standard_normal(config.dense_features)
        self._dense_coef = coef * (_DENSE_NORM / np.linalg.norm(coef))  # [D]
        self._sparse_scale = _SPARSE_STD * math.sqrt(3.0 / len(config.table_sizes))

    def __len__(self) -> int:
        return self.config.num_batches

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[Batch]:
        """Local batches start, start + 1, ..., num_batches - 1 (resume a run at `start`)."""
        if not (_is_int(start) and start >= 0):
            _fail(f"start must be an int >= 0, got {start!r}")
        step, first = 1, start
        worker = get_worker_info()
        if worker is not None:
            step, first = worker.num_workers, start + worker.id
        for i in range(first, self.config.num_batches, step):
            yield self.batch(i)

    def batch(self, index: int) -> Batch:
        """Local batch `index` of this rank (any index >= 0, also past num_batches)."""
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if not (_is_int(index) and index >= 0):
            _fail(f"batch index must be an int >= 0, got {index!r}")
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, index * self.world_size + self.rank])
        num_tables, size = len(cfg.table_sizes), cfg.batch_size
        if cfg.variable_pooling:
            lengths = rng.integers(0, cfg.pooling + 1, size=num_tables * size)  # [T * B]
        else:
            lengths = np.full(num_tables * size, cfg.pooling, dtype=np.int64)
        table_of_bag = np.repeat(np.arange(num_tables), size)  # [T * B]
        tables = np.repeat(table_of_bag, lengths)  # [N]: the table of each id
        ids = self._sample_ids(rng.random(tables.size), tables)  # [N] int64
        dense = np.log1p(rng.exponential(size=(size, cfg.dense_features))).astype(np.float32)
        logit = self._logit(dense, ids, lengths)  # [B]
        labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        weights = None
        if cfg.weighted:  # a stream of their own: ids and labels stay the unweighted log's
            weight_rng = np.random.default_rng([cfg.seed, index * self.world_size + self.rank, 1])
            weights = torch.from_numpy((1.0 - weight_rng.random(ids.size)).astype(np.float32))
        kjt = KeyedJaggedTensor(
            keys=cfg.feature_names,
            values=torch.from_numpy(ids),
            lengths=torch.from_numpy(lengths.astype(np.int32)),
            weights=weights,
            stride=size,
        )
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=kjt,
            labels=torch.from_numpy(labels),
        )

    def hidden_logit(self, batch: Batch) -> torch.Tensor:
        """The logit the labels of `batch` were drawn from, as a [B] float64 tensor."""
        kjt = batch.sparse_features
        logit = self._logit(
            batch.dense_features.numpy(), kjt.values().numpy(), kjt.lengths().numpy()
        )
        return torch.from_numpy(logit)

    def rows_of_ranks(self, table: int, ranks: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of table `table` (its index) at popularity ranks `ranks` (0 the likeliest):
        the ids this log draws for them, e.g. a table's hot rows."""
        r = np.asarray(ranks, dtype=np.int64)
        rows = int(self._rows[table])
        if r.size and (r.min() < 0 or r.max() >= rows):
            _fail(f"ranks must lie in [0, {rows}) for table {table}")
        return self._rows_of(r, np.full(r.shape, table))

    def _rows_of(self, ranks: np.ndarray, tables: np.ndarray) -> np.ndarray:
        """Rows of popularity `ranks` [N] in `tables` [N]: the affine map, with `hash_ids`."""
        if not self.config.hash_ids:
            return ranks
        return (self._a[tables] * ranks + self._b[tables]) % self._rows[tables]

    def _sample_ids(self, u: np.ndarray, tables: np.ndarray) -> np.ndarray:
        """Rows for uniforms `u` [N] of tables `tables` [N]: inverse power-law CDF, then the map."""
        e, near, p0 = self._e[tables], self._near_one[tables], self._p0[tables]
        t = np.maximum(u - p0, 0.0) / p0  # ∫ from 1.5 to x of x^-alpha, x the continuous rank
        e_safe = np.where(near, 1.0, e)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            power = np.log1p(np.maximum(e_safe * t * 1.5 ** (-e_safe), -1.0 + 1e-16)) / e_safe
        x = 1.5 * np.exp(np.where(near, t, power))  # alpha == 1: x = 1.5 * exp(t)
        rows = self._rows[tables]
        ranks = np.where(u < p0, 0, np.clip(np.floor(x - 0.5), 1, rows - 1)).astype(np.int64)
        ranks = np.minimum(ranks, rows - 1)  # one-row tables
        return self._rows_of(ranks, tables)

    def _logit(self, dense: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The hidden logit per sample from dense [B, D], ids [N] and bag lengths [T * B]."""
        cfg = self.config
        num_tables, size = len(cfg.table_sizes), dense.shape[0]
        bags = np.repeat(np.arange(num_tables * size), lengths)  # [N]: bag of each id
        weights = _uniform_hash(cfg.seed, bags // size, ids)  # [N]
        sums = np.bincount(bags, weights=weights, minlength=num_tables * size)  # [T * B]
        means = sums / np.maximum(lengths, 1)  # empty bags contribute 0
        sparse = self._sparse_scale * means.reshape(num_tables, size).sum(axis=0)  # [B]
        return sparse + (dense - _GOMPERTZ) @ self._dense_coef + _LABEL_BIAS
