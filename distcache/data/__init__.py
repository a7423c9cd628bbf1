"""Id traces for benchmarking and testing the cache (synthetic, public and file-based)."""

from distcache.data.traces import (
    Trace,
    TraceUnavailable,
    load_npz,
    movielens_trace,
    parse_trace_spec,
    save_npz,
    zipf_trace,
)

__all__ = [
    "Trace",
    "TraceUnavailable",
    "load_npz",
    "movielens_trace",
    "parse_trace_spec",
    "save_npz",
    "zipf_trace",
]
