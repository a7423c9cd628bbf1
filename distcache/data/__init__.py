"""Data for training and benchmarks: id traces for the cache, synthetic click logs and Criteo
readers (TorchRec `Batch`es).

The batch producers import TorchRec, so they load on first use: `import distcache.data` for a
trace stays light.
"""

from importlib import import_module
from typing import Any

from distcache.data.traces import (
    Trace,
    TraceUnavailable,
    load_npz,
    movielens_trace,
    parse_trace_spec,
    save_npz,
    zipf_trace,
)

_LAZY = {
    "SYNTHETIC_PRESETS": "distcache.data.synthetic",
    "SyntheticClickLog": "distcache.data.synthetic",
    "SyntheticConfig": "distcache.data.synthetic",
    "synthetic_preset": "distcache.data.synthetic",
    "CRITEO_KAGGLE_TABLE_SIZES": "distcache.data.criteo",
    "CRITEO_TERABYTE_TABLE_SIZES": "distcache.data.criteo",
    "CriteoFormatError": "distcache.data.criteo",
    "CriteoNpyReader": "distcache.data.criteo",
    "CriteoTsvReader": "distcache.data.criteo",
}

__all__ = [
    "CRITEO_KAGGLE_TABLE_SIZES",
    "CRITEO_TERABYTE_TABLE_SIZES",
    "CriteoFormatError",
    "CriteoNpyReader",
    "CriteoTsvReader",
    "SYNTHETIC_PRESETS",
    "SyntheticClickLog",
    "SyntheticConfig",
    "Trace",
    "TraceUnavailable",
    "load_npz",
    "movielens_trace",
    "parse_trace_spec",
    "save_npz",
    "synthetic_preset",
    "zipf_trace",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
