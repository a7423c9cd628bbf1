"""The job's edge: each training batch checked in host memory before it enters the pipeline.

A batch is bad when TorchRec would fail on it later or, worse, train on it wrongly: a feature
of the model missing, an unexpected one, or the features in another order (TorchRec fixes the
order at the first batch); ids that are not integers or outside their table; lengths that are
negative, of the wrong count or that do not add up to the ids; dense features or labels of the
wrong shape or not finite; labels outside [0, 1]; per-id weights missing, unexpected, of the
wrong count or not finite. The checks read the loader's host tensors, so
they cost no device read.

`[data] on_bad_batch` decides what a bad batch does:
    "raise"  the job stops with one `InvalidBatchError` naming the batch, the rank and what is
             wrong, before the batch changes any state.
    "skip"   the batch is skipped on every rank (steps stay collective: the ranks agree on
             each batch with a small all-reduce on the host) and counted; it still counts as a
             step of the data, so a resumed job reads the same batches.

Example::

    spec = BatchSpec(features=("f0", "f1"), rows=(100, 50), dense_features=13)
    batches = CheckedBatches(data.train_batches(0), spec, first=0, skip=True)
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from distcache.errors import InvalidBatchError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSpec:
    """What the model takes: its sparse features in order, their tables' rows, dense width."""

    features: tuple[str, ...]
    rows: tuple[int, ...]  # rows of each feature's table
    dense_features: int
    weighted: bool = False  # a weight per id


def batch_problem(batch: Batch, spec: BatchSpec) -> str | None:
    """What is wrong with `batch` for a model of `spec`, or None."""
    sparse = batch.sparse_features
    keys = list(sparse.keys())
    if keys != list(spec.features):
        missing = [f for f in spec.features if f not in keys]
        extra = [k for k in keys if k not in spec.features]
        what = f"missing {missing}, unexpected {extra}" if missing or extra else "out of order"
        return f"its sparse features {keys} are {what}; the model's are {list(spec.features)}"
    values, lengths = sparse.values(), sparse.lengths()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        return f"its ids are {values.dtype}; ids must be torch.int64 or torch.int32"
    samples = sparse.stride()
    if lengths.numel() != len(keys) * samples:
        return (
            f"it has {lengths.numel()} lengths; {len(keys)} features x {samples} samples "
            f"need {len(keys) * samples}"
        )
    if (lengths < 0).any() or int(lengths.sum()) != values.numel():
        return (
            f"its lengths add up to {int(lengths.sum())} ids but it holds {values.numel()}; "
            "lengths must be >= 0 and sum to the number of ids"
        )
    problem = _weights_problem(sparse.weights_or_none(), values.numel(), spec.weighted)
    if problem is not None:
        return problem
    rows = torch.tensor(spec.rows, dtype=torch.int64).repeat_interleave(samples)
    rows_of_id = rows.repeat_interleave(lengths, output_size=values.numel())
    bad = (values < 0) | (values >= rows_of_id)
    if bad.any():
        first = int(bad.to(torch.uint8).argmax())
        feature = keys[int(torch.searchsorted(lengths.cumsum(0), first, right=True)) // samples]
        rows_of = spec.rows[keys.index(feature)]
        return (
            f"feature {feature!r} has id {int(values[first])}, outside its table's rows "
            f"[0, {rows_of})"
        )
    return _dense_problem(batch, spec, samples)


def _weights_problem(weights: torch.Tensor | None, ids: int, weighted: bool) -> str | None:
    if weights is None:
        return "it has no per-id weights; the model's features are weighted" if weighted else None
    if not weighted:
        return "it has per-id weights, which the model's (unweighted) features do not take"
    if weights.numel() != ids or not weights.is_floating_point():
        return f"its weights are {weights.numel()} {weights.dtype} values for {ids} ids"
    if not torch.isfinite(weights).all():
        return "its per-id weights hold NaN or infinite values"
    return None


def _dense_problem(batch: Batch, spec: BatchSpec, samples: int) -> str | None:
    dense, labels = batch.dense_features, batch.labels
    if tuple(dense.shape) != (samples, spec.dense_features):
        expected = [samples, spec.dense_features]
        return f"its dense features are {list(dense.shape)}; expected {expected}"
    if not torch.isfinite(dense).all():
        return "its dense features hold NaN or infinite values"
    if tuple(labels.shape) != (samples,):
        return f"its labels are {list(labels.shape)}; expected [{samples}]"
    if not torch.isfinite(labels).all() or (labels < 0).any() or (labels > 1).any():
        return "its labels are not all finite numbers in [0, 1]"
    return None


class CheckedBatches:
    """`batches` with each one checked, bad ones raised or skipped (see the module docstring).

    Args:
        batches: this rank's training batches, the first of which is step `first`.
        spec: what the model takes.
        first: the step (index in the data) of the first batch.
        skip: skip bad batches (counted in `skipped`) instead of raising.
        group: a host (gloo) process group of all ranks, for `skip` in a multi-rank job.
    """

    def __init__(
        self,
        batches: Iterator[Batch],
        spec: BatchSpec,
        *,
        first: int,
        skip: bool,
        group: dist.ProcessGroup | None = None,
    ):
        self._batches, self._spec, self._next, self._skip = batches, spec, first, skip
        self._group = group
        self.skipped = 0
        self.read: deque[int] = deque()  # the steps of the batches handed out, not yet trained

    def __iter__(self) -> CheckedBatches:
        return self

    def __next__(self) -> Batch:
        while True:
            batch = next(self._batches)  # StopIteration: at the same step on every rank
            index, self._next = self._next, self._next + 1
            problem = batch_problem(batch, self._spec)
            rank = dist.get_rank() if dist.is_initialized() else 0
            if not self._skip:
                if problem is None:
                    self.read.append(index)
                    return batch
                raise InvalidBatchError(
                    f"training batch {index} of rank {rank} is bad: {problem}. Fix the data, or "
                    'set [data] on_bad_batch = "skip" to skip bad batches'
                )
            if not self._bad_anywhere(problem is not None):
                self.read.append(index)
                return batch
            self.skipped += 1
            log.warning(
                "skipped training batch %d on every rank: %s",
                index,
                f"bad here ({problem})" if problem else "bad on another rank",
            )

    def _bad_anywhere(self, bad_here: bool) -> bool:
        if self._group is None:
            return bad_here
        flag = torch.tensor([int(bad_here)], dtype=torch.int32)  # host memory: gloo
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag)


def host_group() -> dist.ProcessGroup | None:
    """A process group of every rank that reduces host tensors (gloo): the default one on CPU,
    a new one beside NCCL. None for one rank. Collective: every rank calls it alike."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")
