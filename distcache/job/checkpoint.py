"""Checkpoints of a training job with `torch.distributed.checkpoint` (DCP), and resume.

A checkpoint holds everything training needs to continue bitwise as if never stopped: the
sharded model (embedding rows, flushed from the caches first, and dense layers), the fused
embedding optimizer's state (which distcache keeps beside each row), the dense optimizer's
state, and the step, which is also each rank's position in its data.

Each checkpoint is a DCP directory `step_XXXXXXXX/` (the dense optimizer, whose state every
rank holds alike, is saved by rank 0 beside it with `torch.save`). Only after every rank has
written its part does rank 0 point `latest.json` at it (written to a temporary file and
renamed), so a job killed mid-save resumes from the previous complete checkpoint. With
`keep_last = N`, rank 0 then deletes all but the newest N complete checkpoints (never the one
`latest.json` names).

Example::

    checkpoints = Checkpointer(Path("runs/x/checkpoints"), every=100)
    step = checkpoints.restore(model, dense_optimizer) or 0
    ...
    if checkpoints.due(step):
        checkpoints.save(step, model, dense_optimizer)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from distcache.errors import CheckpointError

log = logging.getLogger(__name__)
LATEST = "latest.json"


DENSE = "dense_optimizer.pt"
_STEP_DIR = re.compile(r"step_(\d{8})")


def _state(model: nn.Module) -> dict[str, dict[str, object]]:
    """The model's and its fused optimizer's state dicts (DCP saves and loads them in place)."""
    state = {"model": model.state_dict()}  # distcache flushes its caches here
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        state["fused_optimizer"] = fused.state_dict()
    return state


class Checkpointer:
    """Saves every `every` steps into `directory` and restores the latest checkpoint.

    Args:
        directory: shared by all ranks (one file system).
        every: steps between checkpoints (0: only when `save` is called explicitly).
        keep_last: after each save, keep only the newest this many checkpoints (0: all).
    """

    def __init__(self, directory: str | Path, every: int = 0, *, keep_last: int = 0):
        self.directory = Path(directory)
        self.every = every
        self.keep_last = keep_last

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def latest(self) -> int | None:
        """The step of the latest complete checkpoint, or None."""
        pointer = self._pointer()
        return None if pointer is None else pointer[0]

    def _pointer(self) -> tuple[int, int | None] | None:
        """`latest.json`'s step (checked: an integer >= 0) and the world size that saved it
        (None for checkpoints from before it was recorded), or None when there is none."""
        path = self.directory / LATEST
        if not path.is_file():
            return None
        try:
            pointer = json.loads(path.read_text())
            step = pointer["step"]
            problem = None if isinstance(step, int) and step >= 0 else f"step {step!r}"
        except (ValueError, KeyError, TypeError) as err:
            problem = f"{type(err).__name__}: {err}"
        if problem is not None:
            raise CheckpointError(
                f"{path} is corrupt ({problem}); it should read "
                '{"step": N, "path": "step_0000000N"}: fix it, or delete it to start from step 0'
            )
        return step, pointer.get("world_size")

    def save(
        self, step: int, model: nn.Module, dense_optimizer: torch.optim.Optimizer | None = None
    ) -> Path:
        """Write a checkpoint of `step` (every rank calls this; collective)."""
        target = self.directory / f"step_{step:08d}"
        dcp.save(_state(model), checkpoint_id=str(target))
        first = not dist.is_initialized() or dist.get_rank() == 0
        if first and dense_optimizer is not None:
            torch.save(dense_optimizer.state_dict(), target / DENSE)
        if dist.is_initialized():
            dist.barrier()
        if first:
            tmp = self.directory / f".{LATEST}.tmp"
            world = dist.get_world_size() if dist.is_initialized() else 1
            pointer = {"step": step, "path": target.name, "world_size": world}
            tmp.write_text(json.dumps(pointer) + "\n")
            os.replace(tmp, self.directory / LATEST)
            self._prune(keep=target)
        if dist.is_initialized():
            dist.barrier()
        log.info("checkpoint of step %d written to %s", step, target)
        return target

    def _prune(self, keep: Path) -> None:
        """Delete all but the newest `keep_last` checkpoints, never `keep` (rank 0 only)."""
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.directory.iterdir() if _STEP_DIR.fullmatch(p.name))
        for old in steps[: -self.keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
                log.info("deleted the checkpoint %s (keep_last = %d)", old, self.keep_last)

    def restore(
        self,
        model: nn.Module,
        dense_optimizer: torch.optim.Optimizer | None = None,
        *,
        require: bool = False,
    ) -> int | None:
        """Load the latest checkpoint into `model` and `dense_optimizer`; returns its step, or
        None when there is none (collective; with `require`, none is a `CheckpointError`)."""
        pointer = self._pointer()
        if pointer is None:
            if require:
                raise CheckpointError(
                    f"--resume=require: no checkpoint in {self.directory} ({LATEST} is missing)"
                )
            log.warning("no checkpoint in %s: starting from step 0", self.directory)
            return None
        step, saved_by = pointer
        source = self.directory / f"step_{step:08d}"
        if not (source / ".metadata").is_file():
            raise CheckpointError(
                f"{self.directory / LATEST} names step {step}, but {source / '.metadata'} is "
                "missing: the checkpoint is incomplete or was deleted; restore the directory, "
                f"or point {LATEST} at an earlier step_* directory"
            )
        state = _state(model)
        dcp.load(state, checkpoint_id=str(source))
        model.load_state_dict(state["model"])  # distcache refills its stores, empties caches
        if "fused_optimizer" in state:
            model.fused_optimizer.load_state_dict(state["fused_optimizer"])
        if dense_optimizer is not None:
            dense_optimizer.load_state_dict(torch.load(source / DENSE, weights_only=False))
        world = dist.get_world_size() if dist.is_initialized() else 1
        changed = saved_by is not None and saved_by != world
        resharded = f", resharded from {saved_by} ranks to {world}" if changed else ""
        log.info("resumed from the checkpoint of step %d (%s)%s", step, source, resharded)
        return step
