"""Named workloads for the planner: the Criteo DLRMs and a synthetic generator for scale tests.

A spec string names a preset:

- ``criteo-kaggle``, ``criteo-terabyte``: the 26 categorical features of the Criteo datasets,
  one table each (``t0``..``t25``, feature ``t<i>`` reads table ``t<i>``), dim 128, one id per
  feature per sample, and DLRM's MLPs (13 dense features, bottom 512-256-128, top
  1024-1024-512-256-1, as in the MLPerf DLRM reference with dim 128).
- ``synthetic:tables=T,rows=R,dim=D,alpha=A,pooling=P,seed=S,spread=X,mlp=M``: T tables whose
  rows are drawn log-uniformly from [R / X, R] with `seed` (X = 1 gives every table R rows);
  every key is optional (defaults in `SYNTHETIC_DEFAULTS`). MLPs: DLRM's (as Criteo's) with
  `mlp=0`, the default; `mlp=M` sizes them to the tables instead: bottom (M, D), top (M, 1),
  a dense part small enough that placement shows in a step measured on CPU.

Access profiles: every table gets a power law p_r ∝ (r + 1)^-alpha with one exponent,
`CRITEO_ALPHA` = 1.05 — the exponent of distcache's zipf traces, a moderate skew for
click logs (whose large categorical features are heavy-tailed). It is an assumption, not a
fit: for a real dataset build `TableStats(counts=...)` from a data sample instead.

Example::

    workload = workload_preset("criteo-terabyte", batch_size_per_rank=4096)
    scale = workload_preset("synthetic:tables=1000,rows=1e6,seed=3")
"""

from __future__ import annotations

import numpy as np

from distcache.errors import DistcacheConfigError
from distcache.planner.types import TableStats, Workload

CRITEO_TERABYTE_ROWS = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)  # fmt: skip
CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
CRITEO_DIM = 128
CRITEO_ALPHA = 1.05
# Per-GPU batch of the MLPerf DLRM reference setups (global 32768 over 16 GPUs); the global
# batch grows with the world size (weak scaling).
DEFAULT_BATCH_SIZE_PER_RANK = 2048

_CRITEO = {"criteo-kaggle": CRITEO_KAGGLE_ROWS, "criteo-terabyte": CRITEO_TERABYTE_ROWS}
SYNTHETIC = "synthetic"
WORKLOAD_PRESETS = (*_CRITEO, SYNTHETIC)
SYNTHETIC_DEFAULTS: dict[str, float] = {
    "tables": 26,
    "rows": 1_000_000,
    "dim": 128,
    "alpha": CRITEO_ALPHA,
    "pooling": 1.0,
    "seed": 0,
    "spread": 100.0,
    "mlp": 0,
}
_INT_KEYS = ("tables", "rows", "dim", "seed", "mlp")


def workload_preset(
    spec: str, *, batch_size_per_rank: int | None = None, optimizer: str | None = None
) -> Workload:
    """The workload named by `spec` (see the module docstring for the forms).

    Args:
        spec: 'criteo-kaggle', 'criteo-terabyte' or 'synthetic[:key=value,...]'.
        batch_size_per_rank: samples per rank per step (default 2048).
        optimizer: embedding optimizer, a key of `types.OPTIMIZER_STATE` (default 'sgd').

    Example::

        workload = workload_preset("synthetic:tables=8,rows=1e5,spread=1", optimizer="adam")
    """
    name, _, args = spec.partition(":")
    name = name.strip()
    if name not in WORKLOAD_PRESETS:
        raise DistcacheConfigError(
            f"unknown workload preset {name!r}; allowed: {list(WORKLOAD_PRESETS)} "
            f"(synthetic takes keys {sorted(SYNTHETIC_DEFAULTS)})"
        )
    if name in _CRITEO:
        if args.strip():
            raise DistcacheConfigError(f"workload preset {name!r} takes no arguments, got {args!r}")
        tables = tuple(
            TableStats(name=f"t{i}", rows=rows, dim=CRITEO_DIM, alpha=CRITEO_ALPHA)
            for i, rows in enumerate(_CRITEO[name])
        )
    bottom, top = (512, 256, 128), (1024, 1024, 512, 256, 1)
    if name not in _CRITEO:
        values = _parse_synthetic(args)
        tables = _synthetic_tables(values)
        if values["mlp"]:
            bottom, top = (int(values["mlp"]), int(values["dim"])), (int(values["mlp"]), 1)
    extra = {} if optimizer is None else {"optimizer": optimizer}
    return Workload(
        name=spec.strip(),
        tables=tables,
        batch_size_per_rank=batch_size_per_rank or DEFAULT_BATCH_SIZE_PER_RANK,
        dense_in_features=13,
        bottom_mlp=bottom,
        top_mlp=top,
        **extra,
    )


def _parse_synthetic(args: str) -> dict[str, float]:
    values = dict(SYNTHETIC_DEFAULTS)
    for item in filter(None, (part.strip() for part in args.split(","))):
        key, sep, text = (s.strip() for s in item.partition("="))
        if key not in SYNTHETIC_DEFAULTS or not sep:
            raise DistcacheConfigError(
                f"synthetic workload: cannot use {item!r}; give key=value with keys "
                f"{sorted(SYNTHETIC_DEFAULTS)}"
            )
        try:
            number = float(text)
        except ValueError:
            raise DistcacheConfigError(
                f"synthetic workload: {key}={text!r} is not a number"
            ) from None
        if key in _INT_KEYS and number != int(number):
            raise DistcacheConfigError(f"synthetic workload: {key} must be an integer, got {text}")
        values[key] = int(number) if key in _INT_KEYS else number
    for key, low in (
        ("tables", 1),
        ("rows", 1),
        ("dim", 1),
        ("pooling", 1e-9),
        ("spread", 1),
        ("mlp", 0),
    ):
        if values[key] < low:
            raise DistcacheConfigError(
                f"synthetic workload: {key} must be >= {low}, got {values[key]}"
            )
    if values["alpha"] < 0:
        raise DistcacheConfigError(f"synthetic workload: alpha must be >= 0, got {values['alpha']}")
    return values


def _synthetic_tables(values: dict[str, float]) -> tuple[TableStats, ...]:
    """Rows log-uniform in [rows / spread, rows], deterministic in `seed`."""
    rng = np.random.default_rng(int(values["seed"]))
    high = float(values["rows"])
    low = max(1.0, high / values["spread"])
    rows = np.exp(rng.uniform(np.log(low), np.log(high), size=int(values["tables"])))
    return tuple(
        TableStats(
            name=f"t{i}",
            rows=max(1, int(round(r))),
            dim=int(values["dim"]),
            pooling_factor=float(values["pooling"]),
            alpha=float(values["alpha"]),
        )
        for i, r in enumerate(rows)
    )
