"""Third-party warnings that a distcache user cannot act on, filtered where they arise.

TorchRec, torch and FBGEMM warn about their own internals and deprecations whenever a model is
sharded, planned, checkpointed or traced through them: 5 to 20 lines per rank per run, which
hide the warnings that matter. Each entry of `KNOWN` names one such warning precisely, the
start of its message and either the modules that warn it or the logger that logs it, with the
reason it is not the user's concern. Nothing else is filtered: the same warning raised in the
user's own module still shows (unless torch attributes it to a wrapper of its own, as noted),
and Python's `-W` options and `PYTHONWARNINGS` come first (these filters go after theirs).

`install()` runs when distcache is imported.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class KnownWarning:
    message: str
    """A pattern the start of the message matches (`re.match`)."""
    why: str
    """Why the user cannot act on it."""
    category: type[Warning] = FutureWarning
    """A `warnings.warn` of this category, from one of `modules`..."""
    modules: tuple[str, ...] = ()
    """...packages or modules the warning is attributed to (their submodules too)."""
    logger: str = ""
    """Or a log record of this logger (then `category` and `modules` are unused)."""


KNOWN = (
    KnownWarning(
        message="`broadcast_buffers` is deprecated",
        modules=("torchrec",),
        why="TorchRec passes this argument to DDP itself (DistributedModelParallel, its "
        "data-parallel tables); no argument of theirs changes it",
    ),
    KnownWarning(
        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is "
        "deprecated",
        modules=("torch.distributed.c10d_logger",),
        why="DDP and TorchRec call them; torch attributes the warning to its own wrapper "
        "whoever calls",
    ),
    KnownWarning(
        message=r"fbgemm::\w+: an autograd kernel was not registered",
        category=UserWarning,
        modules=("torch.autograd",),
        why="FBGEMM's CPU build registers the lookup of TorchRec's data-parallel tables (its "
        "dense TBE) so, with its backward inside; nothing a caller passes changes it",
    ),
    KnownWarning(
        message="Please use DTensor instead and we are deprecating ShardedTensor",
        modules=("torch.distributed.checkpoint", "torchrec", "distcache"),
        why="TorchRec's sharded tables are ShardedTensors; its modules, distcache's and "
        "torch.distributed.checkpoint use them on every save and load",
    ),
    KnownWarning(
        message="HeuristicalStorageReservation is known to cause issues",
        modules=("torchrec.distributed.planner",),
        why="TorchRec's planner builds it by default; distcache's CachedShardingPlanner is "
        "TorchRec's planner",
    ),
    KnownWarning(
        message="There is a known issue with TorchRec's dense tensor size calculation in dry run",
        logger="torchrec.distributed.planner.storage_reservations",
        why="about dry runs, whose tensors are not materialized; distcache plans real models",
    ),
    KnownWarning(
        message=r"The topology was constructed directly rather than via TopologyFactory\.",
        logger="torchrec.distributed.planner.types",
        why="TorchRec's own planner builds its default topology so, and distcache's planners "
        "build TorchRec topologies from their own; none fails for it",
    ),
    KnownWarning(
        message="is_fx_tracing will return true for both fx.symbolic_trace and torch.export",
        logger="torch.fx._symbolic_trace",
        why="TorchRec's modules ask torch.fx whether they are traced, in every forward",
    ),
    KnownWarning(
        message="Sharding spec not found for ",
        logger="root",
        why="TorchRec logs it on the root logger for every data-parallel table of a plan, "
        "which has no sharding spec",
    ),
    KnownWarning(
        message="Sharding Type is data_parallel, caching params will be ignored",
        logger="torchrec.distributed.utils",
        why="distcache's sharders pass their cache settings for every table; a data-parallel "
        "table is TorchRec's own, uncached (the job's placement log names it)",
    ),
)


class _DropKnown(logging.Filter):
    """Drops a logger's records whose message starts with a match of `pattern`."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(str(record.msg)) is None


def install(known: tuple[KnownWarning, ...] = KNOWN) -> None:
    """Filter the `known` warnings in this process; a filter already there is not added again
    (a test runner that restores the warning filters may call it again)."""
    by_logger: dict[str, list[str]] = {}
    for entry in known:
        if entry.logger:
            by_logger.setdefault(entry.logger, []).append(entry.message)
            continue
        for module in entry.modules:
            warnings.filterwarnings(  # appended once: an equal filter is not added twice
                "ignore",
                message=entry.message,
                category=entry.category,
                module=re.escape(module) + r"(\.|\Z)",
                append=True,
            )
    for name, patterns in by_logger.items():
        logger = logging.getLogger(None if name == "root" else name)
        drop = _DropKnown(patterns)
        if not any(isinstance(f, _DropKnown) and f.pattern == drop.pattern for f in logger.filters):
            logger.addFilter(drop)
