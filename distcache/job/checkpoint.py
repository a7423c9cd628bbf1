"""Checkpoints of a training job with `torch.distributed.checkpoint` (DCP), and resume.

A checkpoint holds everything training needs to continue bitwise as if never stopped: the
sharded model (embedding rows, flushed from the caches first, and dense layers), the fused
embedding optimizer's state (which distcache keeps beside each row), the dense optimizer's
state, and the step, which is also each rank's position in its data.

Each checkpoint is a DCP directory `step_XXXXXXXX/` (the dense optimizer, whose state every
rank holds alike, is saved by rank 0 beside it with `torch.save`). Only after every rank has
written its part does rank 0 point `latest.json` at it (written to a temporary file and
renamed), so a job killed mid-save resumes from the previous complete checkpoint.

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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

log = logging.getLogger(__name__)
LATEST = "latest.json"


DENSE = "dense_optimizer.pt"


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
    """

    def __init__(self, directory: str | Path, every: int = 0):
        self.directory = Path(directory)
        self.every = every

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def latest(self) -> int | None:
        """The step of the latest complete checkpoint, or None."""
        path = self.directory / LATEST
        if not path.is_file():
            return None
        return int(json.loads(path.read_text())["step"])

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
            tmp.write_text(json.dumps({"step": step, "path": target.name}) + "\n")
            os.replace(tmp, self.directory / LATEST)
        if dist.is_initialized():
            dist.barrier()
        log.info("checkpoint of step %d written to %s", step, target)
        return target

    def restore(
        self, model: nn.Module, dense_optimizer: torch.optim.Optimizer | None = None
    ) -> int | None:
        """Load the latest checkpoint into `model` and `dense_optimizer`; returns its step, or
        None when there is none (collective)."""
        step = self.latest()
        if step is None:
            return None
        source = self.directory / f"step_{step:08d}"
        state = _state(model)
        dcp.load(state, checkpoint_id=str(source))
        model.load_state_dict(state["model"])  # distcache refills its stores, empties caches
        if "fused_optimizer" in state:
            model.fused_optimizer.load_state_dict(state["fused_optimizer"])
        if dense_optimizer is not None:
            dense_optimizer.load_state_dict(torch.load(source / DENSE, weights_only=False))
        log.info("resumed from the checkpoint of step %d", step)
        return step
