"""Id traces: the sequences of embedding-row ids a cache is benchmarked and tested on.

A `Trace` is a flat id tensor cut into batches by an offsets tensor (the CSR layout a TorchRec
KeyedJaggedTensor uses). Traces come from a synthetic power-law generator (`zipf_trace`), from a
real public log (`movielens_trace`, MovieLens-100K), or from an `.npz` file (`load_npz`).
`parse_trace_spec` turns a one-line description, as given on a command line, into a trace.
"""

from __future__ import annotations

import logging
import math
import numbers
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

from distcache.errors import DistcacheConfigError, DistcacheError, InvalidBatchError

__all__ = [
    "Trace",
    "TraceUnavailable",
    "load_npz",
    "movielens_trace",
    "parse_trace_spec",
    "save_npz",
    "zipf_trace",
]

logger = logging.getLogger(__name__)

MAX_ZIPF_ROWS = 3_000_000_000
"""Largest id space `zipf_trace` supports: the rank->id scatter multiplies two ids in int64."""

_CHUNK = 1 << 16  # ids generated per step: the float64 scratch stays in the CPU cache
_RECBOLE_VERSION = "1.2.1"
_ML100K_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
_ZIPF_KEYS = ("rows", "alpha", "batch", "batches", "seed")
_SCHEMES = "'zipf:rows=N,alpha=A,batch=B,batches=T[,seed=S]', 'movielens[:batch=B]', '<path>.npz'"


class TraceUnavailable(DistcacheError, RuntimeError):
    """A trace source cannot be obtained here (no network, missing file in a download, ...)."""


@dataclass(frozen=True, eq=False, repr=False)  # eq=False: tensors have no boolean equality
class Trace:
    """Batches of embedding-row ids: batch b is ids[offsets[b]:offsets[b+1]].

    The constructor validates everything a cache relies on, so a bad trace fails here with a
    message instead of as an out-of-range index deep inside a kernel.
    """

    ids: torch.Tensor  # [total] int64, each in [0, num_rows)
    offsets: torch.Tensor  # [batches + 1] int64, offsets[0] == 0, non-decreasing, [-1] == total
    num_rows: int  # size of the id space (table rows)
    name: str  # human-readable description, e.g. "zipf:rows=100000,alpha=1.05,..."

    def __post_init__(self) -> None:
        for field in ("ids", "offsets"):
            t = getattr(self, field)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if torch.is_tensor(t) else t
                raise InvalidBatchError(
                    f"Trace.{field} must be a 1-D torch.int64 tensor, got {got}"
                )
        if isinstance(self.num_rows, bool) or not isinstance(self.num_rows, int):
            raise InvalidBatchError(f"Trace.num_rows must be an int >= 1, got {self.num_rows!r}")
        if self.num_rows < 1:
            raise InvalidBatchError(f"Trace.num_rows must be >= 1, got {self.num_rows}")
        if not isinstance(self.name, str):
            raise InvalidBatchError(f"Trace.name must be a str, got {type(self.name).__name__}")
        off, total = self.offsets, self.ids.numel()
        if off.numel() == 0:
            raise InvalidBatchError("Trace.offsets must have batches + 1 >= 1 entries, got none")
        if int(off[0]) != 0 or int(off[-1]) != total:
            raise InvalidBatchError(
                f"Trace.offsets must start at 0 and end at ids.numel()={total}, "
                f"got first={int(off[0])}, last={int(off[-1])}"
            )
        if off.numel() > 1 and bool((off[1:] < off[:-1]).any()):
            bad = int((off[1:] < off[:-1]).nonzero()[0])
            raise InvalidBatchError(
                f"Trace.offsets must be non-decreasing, but offsets[{bad + 1}]="
                f"{int(off[bad + 1])} < offsets[{bad}]={int(off[bad])}"
            )
        if total:
            lo, hi = (int(v) for v in torch.aminmax(self.ids))
            if lo < 0 or hi >= self.num_rows:
                raise InvalidBatchError(
                    f"Trace.ids must lie in [0, num_rows={self.num_rows}), found min={lo}, max={hi}"
                )

    @property
    def num_batches(self) -> int:
        """Number of batches (offsets.numel() - 1)."""
        return self.offsets.numel() - 1

    def batch(self, b: int) -> torch.Tensor:
        """Ids of batch `b` (0 <= b < num_batches), a view into `ids`."""
        if not 0 <= b < self.num_batches:
            raise IndexError(f"batch index {b} out of range [0, {self.num_batches})")
        return self.ids[int(self.offsets[b]) : int(self.offsets[b + 1])]  # [batch_len]

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Yield each batch's ids in order (views into `ids`)."""
        for start, end in pairwise(self.offsets.tolist()):
            yield self.ids[start:end]

    def num_unique(self) -> int:
        """Number of distinct ids in the whole trace (the rows a full cache would hold)."""
        n = self.ids.numel()
        if n == 0:
            return 0
        if self.num_rows <= 4 * n:  # a dense bitmap beats sorting when the id space is small
            seen = torch.zeros(self.num_rows, dtype=torch.bool, device=self.ids.device)
            seen[self.ids] = True
            return int(seen.sum())
        return int(torch.unique(self.ids).numel())

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, num_rows={self.num_rows}, "
            f"num_batches={self.num_batches}, num_ids={self.ids.numel()})"
        )


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """Return `value` if it is an int in [low, high], else raise a ValueError naming `name`."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise DistcacheConfigError(f"{name} must be an int {allowed}, got {value!r}")
    return int(value)


def _coprime_multiplier(rows: int) -> int:
    """A multiplier in [0, rows) coprime with `rows`, so that rank -> (a * rank + b) % rows is a
    bijection. It starts near rows / golden ratio (consecutive ranks land far apart) and steps
    over odd numbers until gcd(a, rows) == 1; deterministic in `rows`."""
    a = int(rows * 0.6180339887498949) | 1
    while math.gcd(a, rows) != 1:
        a += 2
    return a % rows


def _scatter_params(rows: int) -> tuple[int, int]:
    """(a, b) of the rank -> id bijection id = (a * rank + b) % rows; a * rank fits in int64."""
    return _coprime_multiplier(rows), 0x2545F4914F6CDD1D % rows


def _scatter_ranks(ranks: torch.Tensor, rows: int) -> torch.Tensor:
    """Map popularity ranks to ids in place, id = (a * rank + b) % rows, so hot rows are spread
    over the id space instead of all being small ids (which would flatter range partitioning)."""
    a, b = _scatter_params(rows)
    return ranks.mul_(a).add_(b).remainder_(rows)  # [n] int64 in and out


def _zipf_ids(rows: int, alpha: float, n: int, seed: int) -> torch.Tensor:
    """n power-law ids over rows >= 2 ranks (see `zipf_trace`), as [n] int64, computed in
    chunks that stay in the CPU's cache."""
    # Continuous part on [lo, hi) covers ranks 1..rows-1; rank 0 has weight 1 beside its mass.
    # Exponents within 1e-6 of 1 use the alpha == 1 form (a density change below 1e-4).
    e, lo, hi = 1.0 - alpha, 1.5, rows + 0.5
    log_span, log_lo = math.log(hi / lo), math.log(lo)
    near_one = abs(e) < 1e-6
    c = log_span if near_one else math.expm1(e * log_span)
    p0 = 1.0 / (1.0 + (log_span if near_one else lo**e * c / e))
    # v = (u - p0) / (1 - p0) is in [0, 1) on the tail; u < p0 gives v < 0, below lo: rank 0.
    # uniform_(from, to) draws v * c (alpha == 1) or 1 + v * c (otherwise) in one op.
    v_lo, v_hi = sorted((-p0 / (1.0 - p0) * c, c))
    if not near_one:
        v_lo, v_hi = 1.0 + v_lo, 1.0 + v_hi
    a, b = _scatter_params(rows)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, dtype=torch.int64)  # [n]
    buf = torch.empty(min(n, _CHUNK), dtype=torch.float64)  # [chunk] scratch
    for start in range(0, n, _CHUNK):
        x = buf[: min(_CHUNK, n - start)].uniform_(v_lo, v_hi, generator=gen)
        if near_one:  # x = lo * exp(v * log_span)
            x.add_(log_lo).exp_()
        else:  # x = lo * (1 + v * c)^(1 / e); for alpha < 1, 1 + v * c < 0 means rank 0
            x.clamp_(min=0.0).log_().mul_(1.0 / e).add_(log_lo).exp_()
        x.sub_(0.5).clamp_(0.0, rows - 1)  # rank = floor(x - 0.5), kept in [0, rows)
        out = ids[start : start + x.numel()].copy_(x)  # float -> int64 truncates (x >= 0)
        out.mul_(a).add_(b).remainder_(rows)  # rank -> id, as in _scatter_ranks
    return ids


def zipf_trace(*, rows: int, alpha: float, batch: int, batches: int, seed: int = 0) -> Trace:
    """A synthetic power-law trace, the usual stand-in for embedding-lookup popularity.

    Rank k (0-based) is drawn with probability close to 1 / (k + 1)^alpha. Sampling is a
    vectorized inverse CDF of the continuous bounded power law: rank 0 gets its exact discrete
    share and rank k >= 1 the mass of [k + 0.5, k + 1.5) (a midpoint rule: for alpha <= 1.2 within
    ~3% of the discrete law at rank 1 and ~1% from rank 2 on; the error grows with alpha, e.g.
    +7% at rank 1 for alpha = 2). Ranks are then scattered over the id space by a fixed bijection
    (see `_scatter_ranks`). Deterministic for a given seed.

    Args:
        rows: size of the id space, in [1, MAX_ZIPF_ROWS].
        alpha: power-law exponent, > 0 (1.0 is classic Zipf; larger is more skewed).
        batch: ids per batch, >= 0.
        batches: number of batches, >= 1.
        seed: seed of the torch.Generator that draws the ids, in [0, 2**64).
    """
    rows = _check_int("rows", rows, 1, MAX_ZIPF_ROWS)
    batch = _check_int("batch", batch, 0)
    batches = _check_int("batches", batches, 1)
    seed = _check_int("seed", seed, 0, 2**64 - 1)
    real = isinstance(alpha, numbers.Real) and not isinstance(alpha, bool)
    if not (real and alpha > 0 and math.isfinite(alpha)):
        raise DistcacheConfigError(f"alpha must be a finite float > 0, got {alpha!r}")
    alpha, n = float(alpha), batch * batches
    ids = _zipf_ids(rows, alpha, n, seed) if rows > 1 and n else torch.zeros(n, dtype=torch.int64)
    offsets = torch.arange(batches + 1, dtype=torch.int64) * batch  # [batches + 1]
    name = f"zipf:rows={rows},alpha={alpha!r},batch={batch},batches={batches},seed={seed}"
    return Trace(ids=ids, offsets=offsets, num_rows=rows, name=name)


def save_npz(trace: Trace, path: str | Path) -> None:
    """Write `trace` as an uncompressed .npz with int64 `ids`, `offsets` and scalar `num_rows`.

    Args:
        trace: the trace to save.
        path: destination file, written exactly as given (no suffix is appended).
    """
    with open(path, "wb") as f:
        np.savez(
            f,
            ids=trace.ids.cpu().numpy(),
            offsets=trace.offsets.cpu().numpy(),
            num_rows=np.int64(trace.num_rows),
        )


def load_npz(path: str | Path) -> Trace:
    """Read a trace from an .npz file, e.g. one exported from a production lookup log.

    Args:
        path: .npz file with int64 arrays `ids` (all ids, batch after batch) and `offsets`
            (batch boundaries, length batches + 1, starting at 0); optionally an integer scalar
            `num_rows`, else max(ids) + 1 is used. Narrower integer dtypes are widened to int64.
    """
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DistcacheConfigError(f"{path}: not a readable .npz file ({err})") from err
    found = sorted(arrays)
    tensors = {}
    for key in ("ids", "offsets"):
        if key not in arrays:
            raise DistcacheConfigError(
                f"{path}: missing array {key!r} (found {found}; need ids, offsets)"
            )
        arr = arrays[key]
        if arr.dtype.kind not in "iu" or not np.can_cast(arr.dtype, np.int64):
            raise DistcacheConfigError(
                f"{path}: array {key!r} must be int64, got dtype {arr.dtype}"
            )
        if arr.ndim != 1:
            raise DistcacheConfigError(f"{path}: array {key!r} must be 1-D, got shape {arr.shape}")
        tensors[key] = torch.from_numpy(arr.astype(np.int64, copy=False))
    ids = tensors["ids"]  # [total]
    if "num_rows" in arrays:
        nr = arrays["num_rows"]
        if nr.size != 1 or nr.dtype.kind not in "iu":
            raise DistcacheConfigError(f"{path}: num_rows must be an integer scalar, got {nr!r}")
        num_rows = int(nr.reshape(()))
    elif ids.numel():
        num_rows = int(ids.max()) + 1
    else:
        raise DistcacheConfigError(f"{path}: ids is empty, so num_rows must be stored in the file")
    try:
        return Trace(ids=ids, offsets=tensors["offsets"], num_rows=num_rows, name=f"npz:{path}")
    except ValueError as err:
        raise DistcacheConfigError(f"{path}: {err}") from err


def _recbole_wheel(cache_dir: Path) -> Path:
    """Path of the cached recbole wheel, downloading it with pip on first use."""
    pattern = f"recbole-{_RECBOLE_VERSION}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if found:
        return found[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "15",
           f"recbole=={_RECBOLE_VERSION}", "-d", str(cache_dir)]  # fmt: skip
    logger.info(
        "downloading MovieLens-100K (recbole==%s wheel) into %s", _RECBOLE_VERSION, cache_dir
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise TraceUnavailable(f"movielens: could not run pip download ({err})") from err
    found = sorted(cache_dir.glob(pattern))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip()[-500:]
        raise TraceUnavailable(
            f"movielens: 'pip download recbole=={_RECBOLE_VERSION}' failed "
            f"(exit {proc.returncode}); is the network reachable? {tail}"
        )
    return found[0]


def movielens_trace(*, batch: int, cache_dir: Path | None = None) -> Trace:
    """MovieLens-100K ratings as a trace: 100,000 events over 1,682 items, in time order.

    The data ships inside the recbole wheel on PyPI, so it is fetched with pip (once, then
    reused) and read straight from the zip. Events are sorted by timestamp (ties keep file
    order), item ids become dense rows in order of first appearance, and consecutive events are
    cut into batches (the last one may be shorter).

    Args:
        batch: events per batch, >= 1.
        cache_dir: where the wheel is kept; default ~/.cache/distcache/recbole.
    """
    _check_int("batch", batch, 1)
    cache_dir = (
        Path(cache_dir) if cache_dir is not None else Path.home() / ".cache/distcache/recbole"
    )
    wheel = _recbole_wheel(cache_dir)
    try:
        with zipfile.ZipFile(wheel) as zf:
            text = zf.read(_ML100K_MEMBER).decode("utf-8")
    except (KeyError, OSError, zipfile.BadZipFile) as err:
        raise TraceUnavailable(
            f"movielens: cannot read {_ML100K_MEMBER} from {wheel} ({err}); "
            "delete the file to download it again"
        ) from err
    header, *lines = text.splitlines()
    columns = [h.split(":")[0] for h in header.split("\t")]
    if "item_id" not in columns or "timestamp" not in columns:
        raise TraceUnavailable(f"movielens: unexpected header {header!r} in {wheel}")
    item_col, ts_col = columns.index("item_id"), columns.index("timestamp")
    fields = [line.split("\t") for line in lines if line]
    stamps = np.array([float(f[ts_col]) for f in fields])  # [events] float64
    order = np.argsort(stamps, kind="stable")  # [events]
    dense: dict[str, int] = {}
    rows = [dense.setdefault(fields[i][item_col], len(dense)) for i in order]
    ids = torch.tensor(rows, dtype=torch.int64)  # [events]
    offsets = torch.arange(0, ids.numel() + batch, batch, dtype=torch.int64)  # [batches + 1]
    offsets.clamp_(max=ids.numel())
    name = f"movielens:ml-100k,batch={batch}"
    return Trace(ids=ids, offsets=offsets, num_rows=max(len(dense), 1), name=name)


def _parse_int(key: str, value: str) -> int:
    """Parse an integer that may be written as 1000000, 1_000_000 or 1e6 (if integral)."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        d = Decimal(value)
    except InvalidOperation:
        d = None
    if d is None or not d.is_finite() or d != d.to_integral_value():
        raise DistcacheConfigError(f"trace spec: {key} must be an integer, got {value!r}")
    return int(d)


def _parse_params(scheme: str, text: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """Split 'k1=v1,k2=v2' into a dict, rejecting unknown, duplicate or malformed keys."""
    params: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not value:
            raise DistcacheConfigError(f"trace spec {scheme}: expected key=value, got {item!r}")
        if key not in allowed:
            raise DistcacheConfigError(
                f"trace spec {scheme}: unknown key {key!r}; allowed keys: {allowed}"
            )
        if key in params:
            raise DistcacheConfigError(f"trace spec {scheme}: key {key!r} given twice")
        params[key] = value
    return params


def _merge_batch(scheme: str, params: dict[str, str], batch: int | None) -> None:
    """Fill a missing `batch` key from the argument; a conflicting pair is an error."""
    if batch is None:
        return
    if "batch" in params and _parse_int("batch", params["batch"]) != batch:
        raise DistcacheConfigError(
            f"trace spec {scheme}: batch={params['batch']} conflicts with {batch=}"
        )
    params.setdefault("batch", str(batch))


def parse_trace_spec(spec: str, *, batch: int | None = None) -> Trace:
    """Build a trace from a one-line description (e.g. a --trace command-line flag).

    Args:
        spec: 'zipf:rows=N,alpha=A,batch=B,batches=T[,seed=S]' (ints may be written 1e6),
            'movielens' or 'movielens:batch=B', or a path ending in '.npz'.
        batch: batch size for specs that do not give one (required for 'movielens'); if a spec
            gives a different batch it is an error. Ignored for .npz files, whose batches are
            stored in the file.
    """
    spec = spec.strip()
    if spec.lower().endswith(".npz"):
        return load_npz(Path(spec).expanduser())
    scheme, _, rest = spec.partition(":")
    if scheme == "zipf":
        params = _parse_params(scheme, rest, _ZIPF_KEYS)
        _merge_batch(scheme, params, batch)
        missing = [k for k in _ZIPF_KEYS[:4] if k not in params]
        if missing:
            raise DistcacheConfigError(
                f"trace spec zipf: missing key(s) {missing}; required: {list(_ZIPF_KEYS[:4])}, "
                "optional: ['seed']"
            )
        try:
            alpha = float(params["alpha"])
        except ValueError:
            raise DistcacheConfigError(
                f"trace spec: alpha must be a float, got {params['alpha']!r}"
            ) from None
        ints = {k: _parse_int(k, v) for k, v in params.items() if k != "alpha"}
        return zipf_trace(alpha=alpha, **ints)
    if scheme == "movielens":
        params = _parse_params(scheme, rest, ("batch",))
        _merge_batch(scheme, params, batch)
        if "batch" not in params:
            raise DistcacheConfigError(
                "trace spec movielens: needs a batch size (batch= argument or key)"
            )
        return movielens_trace(batch=_parse_int("batch", params["batch"]))
    raise DistcacheConfigError(
        f"unknown trace scheme {scheme!r} in {spec!r}; allowed schemes: {_SCHEMES}"
    )
