"""Whether a cache can hold the batches in flight, checked before the first batch.

A look-ahead cache pins every row of the batch being looked up and of the K batches staged
ahead of it (`CacheConfig.prefetch_depth`); a reactive one (LRU, LFU) pins one batch's. A cache
smaller than the distinct rows those batches use cannot stage them, and training stops at that
batch with a `CacheCapacityError`. Every entry checks it up front from what it knows of the
data (the ids a batch holds for the table) and treats a cache that cannot hold them the same way:
it raises the cache to the rows the batches in flight can use (the whole table when that is all
of it) and says so at warning level, naming the capacity that would have done.

Entries: `CachedEmbeddingBags(ids_per_batch=...)`, and
`sharding.parameter_sharding.hold_batches_in_flight` (used by `CachedShardingPlanner` and the
training job).

Example::

    short = shortfall("user", CacheConfig(capacity=0.05), num_rows=1000, ids_per_batch=82)
    short.needed_rows                 # 164: 2 batches in flight (K = 1) x 82 ids
    short.raised(CacheConfig(capacity=0.05)).capacity   # 164
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distcache.cache.config import CacheConfig
from distcache.errors import DistcacheConfigError

log = logging.getLogger(__name__)

# A cache's device memory beside its slots' rows (`residency.Residency`, the window's positions,
# the policy's state), as the planners price it: bytes per row of its shard (the slot map and the
# window's latest position, int32 each; a reactive cache's slot map, int64) and per slot (the row
# map, stamp, next use and count, int64 each, the dirty and pin flags).
CACHE_ROW_INDEX_BYTES_LOOKAHEAD = 8
CACHE_ROW_INDEX_BYTES_REACTIVE = 8
CACHE_SLOT_BYTES = 40


def maps_bytes(num_rows: int, slots: int, reactive: bool = False) -> int:
    """Device bytes of the maps of a cache of `slots` slots for a shard of `num_rows` rows
    (beside the slots' rows): a look-ahead cache's, or a `reactive` one's."""
    index = CACHE_ROW_INDEX_BYTES_REACTIVE if reactive else CACHE_ROW_INDEX_BYTES_LOOKAHEAD
    return num_rows * index + slots * CACHE_SLOT_BYTES


def pinned_batches(config: CacheConfig) -> int:
    """Batches whose rows a cache holds at once: the one looked up and the K staged ahead of
    it (a reactive policy stages a batch only when it is looked up)."""
    return 1 if config.is_reactive else config.prefetch_depth + 1


def rows_in_flight(config: CacheConfig, num_rows: int, ids_per_batch: float) -> int:
    """The most distinct rows of a table of `num_rows` rows that its batches in flight can
    use, when a batch holds at most `ids_per_batch` of its ids."""
    return min(num_rows, math.ceil(pinned_batches(config) * ids_per_batch - 1e-9))


@dataclass(frozen=True, kw_only=True)
class Shortfall:
    """A cache that cannot hold the rows of its batches in flight."""

    table: str
    num_rows: int
    capacity: float | int
    """The capacity asked for (`CacheConfig.capacity`)."""
    capacity_rows: int
    """The rows that capacity gives the table."""
    needed_rows: int
    """The most distinct rows the batches in flight can use (`rows_in_flight`)."""
    ids_per_batch: float
    batches: int
    """Batches in flight (`pinned_batches`)."""

    @property
    def whole(self) -> bool:
        return self.needed_rows >= self.num_rows

    def raised(self, config: CacheConfig) -> CacheConfig:
        """`config` with a capacity that holds the batches in flight."""
        return dataclasses.replace(config, capacity=1.0 if self.whole else self.needed_rows)

    def message(self) -> str:
        """One line: the table, what it holds, what it needs, what was done and what to set."""
        raised = "cached whole" if self.whole else f"its cache raised to {self.needed_rows:,} rows"
        return (
            f"table {self.table!r}: capacity {self.capacity} holds {self.capacity_rows:,} of "
            f"its {self.num_rows:,} rows, fewer than the up to {self.needed_rows:,} distinct "
            f"rows of its {self.batches} batch(es) in flight ({self.ids_per_batch:,.0f} ids a "
            f"batch): {raised}. Set capacity {self._setting()}, or a smaller prefetch_depth, to "
            "choose it yourself"
        )

    def _setting(self) -> str:
        if self.whole:
            return "= 1.0 (every row)"
        return f">= {self.needed_rows} rows ({self.needed_rows / self.num_rows:.3g} of the table)"


def shortfall(
    table: str, config: CacheConfig, num_rows: int, ids_per_batch: float
) -> Shortfall | None:
    """The `Shortfall` of `table`'s cache (`num_rows`: the rows of its shard) when a batch
    holds at most `ids_per_batch` of its ids; None when the cache holds them."""
    have = config.capacity_rows(num_rows)
    need = rows_in_flight(config, num_rows, ids_per_batch)
    if have >= need:
        return None
    return Shortfall(
        table=table,
        num_rows=num_rows,
        capacity=config.capacity,
        capacity_rows=have,
        needed_rows=need,
        ids_per_batch=ids_per_batch,
        batches=pinned_batches(config),
    )


def per_table(
    ids_per_batch: float | Sequence[float] | Mapping[str, float] | None, names: Sequence[str]
) -> list[float | None]:
    """`ids_per_batch` for each of the tables `names` (None where unknown): one bound for every
    table, one per table in order, or a mapping by name (tables left out are unknown).

    Raises:
        DistcacheConfigError: a bound that is not a number >= 0, a sequence of the wrong length,
            or a name that is not a table's.
    """
    if ids_per_batch is None:
        return [None] * len(names)
    if isinstance(ids_per_batch, Mapping):
        unknown = sorted(set(ids_per_batch) - set(names))
        if unknown:
            raise DistcacheConfigError(
                f"ids_per_batch names {unknown}, which are not tables (tables: {list(names)})"
            )
        values = [ids_per_batch.get(n) for n in names]
    elif isinstance(ids_per_batch, Sequence):
        if len(ids_per_batch) != len(names):
            raise DistcacheConfigError(
                f"ids_per_batch has {len(ids_per_batch)} entries: expected one per table "
                f"({len(names)})"
            )
        values = list(ids_per_batch)
    else:
        values = [ids_per_batch] * len(names)
    for name, v in zip(names, values, strict=True):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
            raise DistcacheConfigError(
                f"ids_per_batch of table {name!r} is {v!r}: expected a number >= 0"
            )
    return values


def shared_capacity(
    tables: Sequence[tuple[str, int, float | None, CacheConfig]],
) -> tuple[int, list[Shortfall]]:
    """The rows of one cache shared by `tables` ((name, rows, ids a batch or None, its config:
    the same but for the capacity)): their caches together (`CacheConfig.capacity_rows`),
    raised when together they cannot hold the rows of the batches in flight, and the tables
    that raised it.

    A table short on its own is covered by the others' spare rows, since the cache is shared;
    when they do not cover it, each short table's part is raised to what it needs.
    """
    have = [config.capacity_rows(rows) for _, rows, _, config in tables]
    shorts = [
        shortfall(name, config, rows, ids) if ids is not None else None
        for name, rows, ids, config in tables
    ]
    needed = [h if s is None else max(h, s.needed_rows) for h, s in zip(have, shorts, strict=True)]
    spare = sum(
        h - rows_in_flight(config, rows, ids)
        for h, (_, rows, ids, config), s in zip(have, tables, shorts, strict=True)
        if s is None and ids is not None
    )
    if sum(needed) - sum(have) <= spare:
        return sum(have), []
    return sum(needed), [s for s in shorts if s is not None]


def log_shortfalls(shortfalls: Sequence[Shortfall], where: str) -> None:
    """The shortfalls at warning level, prefixed with `where` (the entry that raised them): one
    line, whatever their number (a job's tiny tables would otherwise fill a screen)."""
    if len(shortfalls) == 1:
        log.warning("%s: %s", where, shortfalls[0].message())
    elif shortfalls:
        log.warning("%s: %s", where, _summary(shortfalls))


def _summary(shortfalls: Sequence[Shortfall]) -> str:
    """One line for several tables' shortfalls: each one's rows, before and after."""
    each = ", ".join(
        f"{s.table!r} {s.capacity_rows:,} -> "
        + (f"all {s.num_rows:,}" if s.whole else f"{s.needed_rows:,} of {s.num_rows:,}")
        for s in shortfalls
    )
    batches = sorted({s.batches for s in shortfalls})
    return (
        f"{len(shortfalls)} tables' caches hold fewer rows than the distinct rows of their "
        f"{'/'.join(map(str, batches))} batch(es) in flight and were raised (rows): {each}. Set "
        "their capacity to at least that, or a smaller prefetch_depth, to choose it yourself"
    )
