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
    stats = TableStats(name="t0", rows=rows, dim=64, alpha=fitted_alpha(counts[0]))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from torchrec.datasets.utils import Batch

from distcache.errors import DistcacheConfigError


def id_counts(batches: Iterable[Batch], table_sizes: Sequence[int]) -> list[np.ndarray]:
    """Per table (feature i reads table i, as in the job's DLRM), `[rows]` int64: how many of
    the batches' ids read each row.

    Raises:
        DistcacheConfigError: an id outside its table, a batch with another number of
            features, or no batch at all.
    """
    counts = [np.zeros(rows, dtype=np.int64) for rows in table_sizes]
    seen = 0
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
            counts[table] += np.bincount(ids, minlength=rows)
        seen += 1
    if not seen:
        raise DistcacheConfigError("the id sample has no batch: the data yielded none")
    return counts
