"""Id counts of a data sample: what the planner knows of a real dataset's tables.

A synthetic click log knows its tables' popularity; Criteo data does not. A job counts the ids of
its first training batches (`[plan] sample_batches`) per table, and the counts give the planner
each table's access profile (`distcache.planner.stats.fitted_alpha`) and its hottest rows.

A sample sees only part of a table's tail, so its counts are no profile: rows it never saw
are not unlikely, only unseen, and a cache sized from them would look as if it never missed.
`fitted_alpha` fits the power law under which a sample of its size sees as many distinct rows
as it did; the planner prices the table with that law, and the sample's most counted rows are
the ones it replicates.

Example::

    counts = id_counts(itertools.islice(data.train_batches(), 64), data.table_sizes)
    t0 = counts[0]
    alpha = fitted_alpha(t0.rows, t0.lookups, t0.seen)  # distcache.planner.stats
    hot = t0.hottest(100)  # the rows a plan replicates
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from torchrec.datasets.utils import Batch

from distcache.errors import DistcacheConfigError


@dataclass(frozen=True)
class TableSample:
    """One table's ids in a sample: the distinct rows read and how often (memory of the
    sample's size, not the table's)."""

    rows: int  # the table's rows
    ids: np.ndarray  # [seen] int64 the distinct rows read, increasing
    counts: np.ndarray  # [seen] int64 how many lookups read each

    @property
    def lookups(self) -> int:
        return int(self.counts.sum())

    @property
    def seen(self) -> int:
        return int(self.ids.size)

    def hottest(self, count: int) -> list[int]:
        """The `count` most read rows (ties: the lower row first), in increasing order."""
        order = np.argsort(-self.counts, kind="stable")[:count]
        return sorted(self.ids[order].tolist())


def id_counts(batches: Iterable[Batch], table_sizes: Sequence[int]) -> list[TableSample]:
    """Per table (feature i reads table i, as in the job's DLRM), the batches' ids counted.

    Raises:
        DistcacheConfigError: an id outside its table, a batch with another number of
            features, or no batch at all.
    """
    parts: list[list[np.ndarray]] = [[] for _ in table_sizes]
    for batch in batches:
        features = batch.sparse_features
        ends = features.offset_per_key()
        if len(ends) - 1 != len(table_sizes):
            raise DistcacheConfigError(
                f"a sampled batch has {len(ends) - 1} features; the job has "
                f"{len(table_sizes)} tables"
            )
        values = features.values().numpy()
        for table, rows in enumerate(table_sizes):
            ids = values[ends[table] : ends[table + 1]]
            if ids.size and (ids.min() < 0 or ids.max() >= rows):
                raise DistcacheConfigError(
                    f"a sampled batch has ids of table {table} outside [0, {rows})"
                )
            parts[table].append(ids.astype(np.int64))
    if not parts or not parts[0]:
        raise DistcacheConfigError("the id sample has no batch: the data yielded none")
    samples = []
    for rows, ids in zip(table_sizes, parts, strict=True):
        distinct, counts = np.unique(np.concatenate(ids), return_counts=True)
        samples.append(TableSample(rows=rows, ids=distinct, counts=counts))
    return samples
