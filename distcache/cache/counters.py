"""The counters a cache reports, declared once: `Counters`, what a scheduler counts, and
`CacheStats`, those with the cache's sizes and host times (`CacheEngine.stats`).

Whatever passes counters on derives them from these two dataclasses instead of listing their
names: the engine copies a scheduler's `Counters` into its `CacheStats` (`asdict`),
`sum_stats` adds up several caches (`LookaheadTrainPipeline.stats()["total"]`), and the
training job writes the counters marked `LOGGED` to its `metrics.jsonl`. A new counter is one
field here, plus the code that counts it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields

# Field metadata. A counter marked `_JOB_METRIC` is in the training job's metrics (summed over the
# ranks); a field marked `_ONE_CACHE` describes one cache and is left out of `sum_stats`.
_JOB_METRIC = {"logged": True}
_ONE_CACHE = {"per_cache": True}


@dataclass
class Counters:
    """What a cache's scheduler counted since it was built (`Scheduler.counters`)."""

    batches: int = 0
    """Batches enqueued."""
    ids: int = 0
    """Ids enqueued, padding (the sentinel row) not counted."""
    unique: int = 0
    """Distinct rows of each staged batch, summed over batches."""
    hits: int = 0
    """Of `unique`, the rows already resident when their batch was staged."""
    loads: int = field(default=0, metadata=_JOB_METRIC)
    """Rows loaded from the host store into a slot."""
    writebacks: int = field(default=0, metadata=_JOB_METRIC)
    """Dirty victims written back to the host store (a `flush` not counted)."""
    evictions: int = 0
    """Resident rows whose slot was given to another row."""
    critical_misses: int = field(default=0, metadata=_JOB_METRIC)
    """Misses of batches staged only when they were looked up (their loads stall training)."""


@dataclass(kw_only=True)
class CacheStats(Counters):
    """Counters of one cache since it was built, with its sizes and host times."""

    bytes_loaded: int
    bytes_written: int
    capacity: int
    num_rows: int
    staging_s: float = 0.0
    """Host time spent planning and queueing batches staged ahead of their lookup."""
    wait_s: float = 0.0
    """Host time lookups spent staging or waiting for rows (the critical path)."""
    graph_captures: int = field(default=0, metadata=_ONE_CACHE)
    """With `CacheConfig.cuda_graphs`: graphs of the scheduler's work captured (one per batch
    size and call, again after `reset`)."""
    graph_replays: int = field(default=0, metadata=_ONE_CACHE)
    """With `CacheConfig.cuda_graphs`: the scheduler's calls served by replaying one."""

    @property
    def hit_rate(self) -> float:
        """Fraction of a batch's unique rows found resident when it was staged."""
        return _hit_rate(self.hits, self.unique)

    def as_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "hit_rate": self.hit_rate}


#: Every counter, in field order.
COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(Counters))
#: The counters the training job logs.
LOGGED: tuple[str, ...] = tuple(f.name for f in fields(Counters) if f.metadata.get("logged"))
#: The fields of `CacheStats` that `sum_stats` adds up: the counters, sizes and times.
SUMMED: tuple[str, ...] = tuple(
    f.name for f in fields(CacheStats) if not f.metadata.get("per_cache")
)


def sum_stats(stats: Iterable[CacheStats]) -> dict[str, float | int]:
    """Several caches' stats added up field by field (`SUMMED`), with the hit rate over all.

    Example::

        total = sum_stats(cached.stats().values())
        print(total["loads"], total["hit_rate"])
    """
    stats = list(stats)
    total: dict[str, float | int] = {name: sum(getattr(s, name) for s in stats) for name in SUMMED}
    total["hit_rate"] = _hit_rate(total["hits"], total["unique"])
    return total


def _hit_rate(hits: float, unique: float) -> float:
    return hits / unique if unique else 0.0
