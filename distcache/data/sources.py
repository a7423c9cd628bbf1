"""A training job's data: its batches for training and evaluation, and the table sizes they
imply, from the `[data]` section of a job config (synthetic, Criteo TSV or Criteo npy).

Each rank reads its own part. Training batches are numbered per rank; a resumed job starts at
its checkpoint's step. Criteo files are read again from the start when a rank runs out (epochs),
so every rank trains the same number of steps.

Example::

    data = JobData(config.data, steps=1000, rank=0, world_size=2)
    for batch in data.train_batches(start=0):
        ...
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

from torchrec.datasets.utils import Batch

from distcache.data.criteo import (
    CRITEO_KAGGLE_TABLE_SIZES,
    INT_FEATURE_COUNT,
    CriteoNpyReader,
    CriteoTsvReader,
)
from distcache.data.synthetic import SyntheticClickLog, synthetic_preset
from distcache.errors import DistcacheConfigError

_HELD_OUT = 1 << 30  # synthetic evaluation batches are numbered from here: never trained on


class JobData:
    """Batches of one rank for a training job.

    Args:
        config: the job's `[data]` section (`distcache.job.config.DataConfig`).
        steps: training batches per rank.
        rank: this rank.
        world_size: ranks of the job.
    """

    def __init__(self, config: Any, *, steps: int, rank: int, world_size: int):
        self.config, self.steps, self.rank, self.world_size = config, steps, rank, world_size
        if config.source == "synthetic":
            synthetic = synthetic_preset(config.preset)
            synthetic = dataclasses.replace(
                synthetic,
                batch_size=config.batch_size,
                num_batches=steps,
                seed=config.seed,
                weighted=config.weighted,
                **({"table_sizes": tuple(config.table_sizes)} if config.table_sizes else {}),
            )
            self._log = SyntheticClickLog(synthetic, rank=rank, world_size=world_size)
            self.table_sizes = synthetic.table_sizes
            self.alphas = synthetic.alphas
            self.dense_features = synthetic.dense_features
            self.max_ids_per_sample = synthetic.pooling
        else:
            self.table_sizes = tuple(config.table_sizes or CRITEO_KAGGLE_TABLE_SIZES)
            if len(self.table_sizes) != 26:
                raise DistcacheConfigError(
                    f"[data] table_sizes has {len(self.table_sizes)} entries: Criteo has 26 tables"
                )
            self.alphas = (1.05,) * 26  # for planning only; see distcache.planner.workloads
            self.dense_features = INT_FEATURE_COUNT
            self.max_ids_per_sample = 1

    def hottest_rows(self, table: int, count: int) -> list[int] | None:
        """Table `table`'s `count` likeliest rows, where the data knows them (synthetic: its
        hashed popularity ranks); None for Criteo (no sample of its ids is counted)."""
        if self.config.source != "synthetic":
            return None
        return self._log.rows_of_ranks(table, range(count)).tolist()

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """This rank's training batches `start, start + 1, ..., steps - 1`."""
        if self.config.source == "synthetic":
            return self._log.iter_from(start)
        epochs = itertools.chain.from_iterable(self._reader(self.config.paths) for _ in _forever())
        return itertools.islice(epochs, start, self.steps)

    def eval_batches(self) -> list[Batch]:
        """Held-out batches of this rank (synthetic: never trained on; Criteo: `eval_paths`)."""
        n = self.config.eval_batches
        if self.config.source == "synthetic":
            return [self._log.batch(_HELD_OUT + i) for i in range(n)]
        if not self.config.eval_paths:
            return []
        return list(itertools.islice(iter(self._reader(self.config.eval_paths)), n))

    def _reader(self, paths: list[str]) -> Any:
        common = dict(
            table_sizes=self.table_sizes,
            batch_size=self.config.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=True,  # equal batches on every rank
        )
        if self.config.source == "criteo_tsv":
            return CriteoTsvReader(paths, **common)
        return CriteoNpyReader.from_day(paths[0], self.config.day, **common)


def _forever() -> Iterator[None]:
    while True:
        yield None
