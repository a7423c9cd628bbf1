"""Checkpoints of a training job with `torch.distributed.checkpoint` (DCP), and resume.

A checkpoint holds everything training needs to continue bitwise as if never stopped: the
sharded model (embedding rows, flushed from the caches first, and dense layers), the fused
embedding optimizer's state (which distcache keeps beside each row), the dense optimizer's
state, the step, which is also each rank's position in its data, and each rank's random
generators (torch's, on the CPU and the rank's GPU: stochastic rounding of half-precision rows,
FBGEMM's default on CUDA, draws from them), restored where the world size is the one saved.

Each checkpoint is a DCP directory `step_XXXXXXXX/` (the dense optimizer, whose state every
rank holds alike, is saved by rank 0 beside it with `torch.save`). Only after every rank has
written its part does rank 0 point `latest.json` at it (written to a temporary file and
renamed), so a job killed mid-save resumes from the previous complete checkpoint. With
`keep_last = N`, rank 0 then deletes all but the newest N complete checkpoints (never the one
`latest.json` names).

Each checkpoint proves itself: before `latest.json` names it, its files' sizes and SHA-256
digests are written to `checksums.json` in it (every rank hashes a share of the files). On
restore they are verified first (again shared by the ranks). A checkpoint that fails (a file
missing, truncated or changed) is named with the reason, renamed `step_XXXXXXXX.corrupt` (kept,
not deleted) and the job falls back to the newest earlier checkpoint that verifies, saying so;
when none does, restore raises `CheckpointError`. (Keep `keep_last >= 2` to have one to fall
back to.) A checkpoint written before checksums existed loads unverified, with a warning.
Without `latest.json` (deleted, or lost with a copy), restore takes the newest checkpoint
directory that verifies, says so and names it in a new `latest.json`.

A checkpoint is never overwritten by a run that did not load it: a run that starts from step 0
and saves into a directory holding checkpoints refuses (`guard_fresh_start`, naming them),
unless told to start over; then they are moved into `superseded.N/` there, not deleted.

Example::

    checkpoints = Checkpointer(Path("runs/x/checkpoints"), every=100)
    step = checkpoints.restore(model, dense_optimizer) or 0
    ...
    if checkpoints.due(step):
        checkpoints.save(step, model, dense_optimizer)
"""

from __future__ import annotations

import hashlib
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
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distcache.errors import CheckpointError

log = logging.getLogger(__name__)
LATEST = "latest.json"


DENSE = "dense_optimizer.pt"
RNG = "random_rank{rank:05d}.pt"  # each rank's generators' states
MANIFEST = "checksums.json"
_STEP_DIR = re.compile(r"step_(\d{8})")
_CHUNK = 8 << 20  # bytes read per hash update


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(items: list[object]) -> list[object]:
    """Every rank's `items`, concatenated in rank order (the same list on every rank)."""
    if not dist.is_initialized():
        return items
    parts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]  # type: ignore[union-attr]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(directory: Path) -> None:
    """Hash the checkpoint's files, a share per rank, into `checksums.json` (collective; every
    rank's files are written and visible, after a barrier)."""
    rank, world = _rank_world()
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    mine = [(n, (directory / n).stat().st_size, _sha256(directory / n)) for n in names[rank::world]]
    entries = _gather(mine)
    if rank == 0:
        manifest = {n: {"bytes": size, "sha256": sha} for n, size, sha in entries}  # type: ignore[misc]
        tmp = directory / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"files": manifest}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, directory / MANIFEST)


def verify(directory: Path) -> str | None:
    """Why the checkpoint in `directory` cannot be loaded, or None when it verifies (or was
    written before checksums existed: then it is logged as unverified). Collective: every rank
    checks a share of the files and all get the same answer."""
    if not directory.is_dir():
        return f"{directory} does not exist"
    if not (directory / ".metadata").is_file():
        return f"{directory / '.metadata'} is missing: the checkpoint is incomplete"
    path = directory / MANIFEST
    if not path.is_file():
        log.warning(
            "%s has no %s (written by an older distcache): loaded unverified", directory, MANIFEST
        )
        return None
    try:
        files = json.loads(path.read_text())["files"]
        expected = sorted((name, e["bytes"], e["sha256"]) for name, e in files.items())
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{path} is corrupt ({type(err).__name__}: {err})"
    rank, world = _rank_world()
    problems: list[object] = []
    for name, size, sha in expected[rank::world]:
        file = directory / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{file} has {file.stat().st_size} bytes, {size} were written")
        elif _sha256(file) != sha:
            problems.append(f"{file} does not match its SHA-256 in {MANIFEST}")
    problems = _gather(problems)
    return "; ".join(map(str, problems)) if problems else None


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

    def steps_on_disk(self) -> list[int]:
        """The steps of the checkpoint directories here (complete or not), oldest first."""
        if not self.directory.is_dir():
            return []
        names = (_STEP_DIR.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in names if m)

    def guard_fresh_start(self, *, start_over: bool = False) -> None:
        """Before a run that starts from step 0 and saves here: raise `CheckpointError` when
        this directory holds checkpoints (they would be overwritten), unless `start_over`:
        then rank 0 moves them into `superseded.N/` beside them (kept) and says so.
        Collective (every rank looks before anything moves)."""
        steps, latest = self.steps_on_disk(), (self.directory / LATEST).is_file()
        if not steps and not latest:
            return
        found = _found(steps, latest)
        if not start_over:
            raise CheckpointError(
                f"{self.directory} holds checkpoints ({found}) that this run, starting from "
                "step 0, would overwrite: --resume continues from them, --resume=never starts "
                "over and keeps them in superseded.N/ there, or choose another [checkpoint] dir"
            )
        if dist.is_initialized():
            dist.barrier()
        if _rank_world()[0] == 0:
            n = 0
            while (self.directory / f"superseded.{n}").exists():
                n += 1
            target = self.directory / f"superseded.{n}"
            target.mkdir()
            for name in [LATEST] * latest + [f"step_{s:08d}" for s in steps]:
                os.replace(self.directory / name, target / name)
            log.warning("starting over from step 0: the checkpoints here (%s) moved to %s",
                        found, target)  # fmt: skip
        if dist.is_initialized():
            dist.barrier()

    def save(
        self, step: int, model: nn.Module, dense_optimizer: torch.optim.Optimizer | None = None
    ) -> Path:
        """Write a checkpoint of `step` (every rank calls this; collective)."""
        target = self.directory / f"step_{step:08d}"
        dcp.save(_state(model), checkpoint_id=str(target))
        first = not dist.is_initialized() or dist.get_rank() == 0
        if first and dense_optimizer is not None:
            torch.save(dense_optimizer.state_dict(), target / DENSE)
        torch.save(_generators(), target / RNG.format(rank=_rank_world()[0]))
        if dist.is_initialized():
            dist.barrier()
        _write_manifest(target)
        if first:
            self._point_at(step)
            self._prune(keep=target)
        if dist.is_initialized():
            dist.barrier()
        log.info("checkpoint of step %d written to %s", step, target)
        return target

    def _point_at(self, step: int) -> None:
        """Name `step` in `latest.json`: a temporary file renamed over it (rank 0 only)."""
        tmp = self.directory / f".{LATEST}.tmp"
        pointer = {"step": step, "path": f"step_{step:08d}", "world_size": _rank_world()[1]}
        tmp.write_text(json.dumps(pointer) + "\n")
        os.replace(tmp, self.directory / LATEST)

    def _prune(self, keep: Path) -> None:
        """Delete all but the newest `keep_last` checkpoints, never `keep` (rank 0 only)."""
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.directory.iterdir() if _STEP_DIR.fullmatch(p.name))
        for old in steps[: -self.keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
                log.info("deleted the checkpoint %s (keep_last = %d)", old, self.keep_last)

    def _verified(self, step: int) -> int:
        """`step` if its checkpoint verifies, else the newest earlier one that does (the
        failed ones renamed `.corrupt`, `latest.json` pointed at the good one). Collective."""
        earlier = sorted(
            (
                int(m.group(1))
                for p in self.directory.iterdir()
                if (m := _STEP_DIR.fullmatch(p.name))
            ),
            reverse=True,
        )
        failed: list[tuple[int, str]] = []
        for candidate in [step, *(s for s in earlier if s < step)]:
            problem = verify(self.directory / f"step_{candidate:08d}")
            if problem is None:
                break
            log.warning("the checkpoint of step %d failed verification: %s", candidate, problem)
            failed.append((candidate, problem))
        else:
            reasons = "; ".join(f"step {s}: {p}" for s, p in failed)
            raise CheckpointError(
                f"no checkpoint in {self.directory} verifies ({reasons}); restore the files, or "
                f"move the directory away to start from step 0"
            )
        if failed:
            log.warning(
                "falling back to the checkpoint of step %d; the failed one(s) are kept as "
                "step_*.corrupt",
                candidate,
            )
            if _rank_world()[0] == 0:
                for bad, _ in failed:
                    self._set_aside(self.directory / f"step_{bad:08d}")
                self._point_at(candidate)
            if dist.is_initialized():
                dist.barrier()
        return candidate

    def _set_aside(self, directory: Path) -> None:
        """Rename a checkpoint that failed verification to `<name>.corrupt[.N]` (rank 0)."""
        if not directory.exists():
            return
        target, n = directory.with_name(f"{directory.name}.corrupt"), 1
        while target.exists():
            target, n = directory.with_name(f"{directory.name}.corrupt.{n}"), n + 1
        os.replace(directory, target)

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
        named = pointer is not None  # (decided by every rank before rank 0 writes one)
        if pointer is None:
            steps = self.steps_on_disk()
            if not steps:
                if require:
                    raise CheckpointError(
                        f"--resume=require: no checkpoint in {self.directory} (no {LATEST}, "
                        "no step_* directory)"
                    )
                log.warning("no checkpoint in %s: starting from step 0", self.directory)
                return None
            log.warning(
                "%s is missing in %s (%s): resuming from the newest that verifies",
                LATEST, self.directory, _found(steps, False),
            )  # fmt: skip
            pointer = (steps[-1], None)
        step, saved_by = pointer
        step = self._verified(step)
        if not named:
            if _rank_world()[0] == 0:
                self._point_at(step)
            if dist.is_initialized():
                dist.barrier()
        source = self.directory / f"step_{step:08d}"
        state = _state(model)
        _check_shapes(state, source)
        try:
            dcp.load(state, checkpoint_id=str(source))
        except (Exception, CheckpointException) as err:  # DCP's name no file, often no cause
            raise CheckpointError(
                f"loading the checkpoint {source} failed ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[-1] if str(err).strip() else 'no message'}): was "
                "it written by this model and a compatible distcache?"
            ) from err
        model.load_state_dict(state["model"])  # distcache refills its stores, empties caches
        if "fused_optimizer" in state:
            model.fused_optimizer.load_state_dict(state["fused_optimizer"])
        if dense_optimizer is not None:
            dense_optimizer.load_state_dict(torch.load(source / DENSE, weights_only=False))
        world = dist.get_world_size() if dist.is_initialized() else 1
        changed = saved_by is not None and saved_by != world
        resharded = (
            f", resharded from {saved_by} ranks to {world} (the random generators continue "
            "from the seed)"
            if changed
            else ""
        )
        if not changed:
            _restore_generators(source)
        log.info("resumed from the checkpoint of step %d (%s)%s", step, source, resharded)
        return step


def _generators() -> dict[str, torch.Tensor | None]:
    """This rank's random generators' states: torch's on the CPU and on its current GPU."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _restore_generators(source: Path) -> None:
    """Set this rank's random generators as the checkpoint in `source` saved them, so that
    what draws from them (stochastic rounding) continues as an uninterrupted run would. A
    checkpoint without them (written by an older distcache) is said so and loads."""
    path = source / RNG.format(rank=_rank_world()[0])
    if not path.is_file():
        log.warning(
            "%s is missing (written by an older distcache): the random generators continue "
            "from the seed, so what draws from them (stochastic rounding of half-precision "
            "rows) will not repeat an uninterrupted run's draws",
            path,
        )
        return
    states = torch.load(path, weights_only=True)
    torch.set_rng_state(states["cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _check_shapes(state: dict[str, dict[str, object]], source: Path) -> None:
    """Raise `CheckpointError` on every rank when the checkpoint in `source` holds tensors
    of other shapes than `state`'s, or lacks some of them: it was written by another model (a
    table's rows or width, a layer's size changed). Names the tables (or tensors) and both
    shapes; DCP itself would fail with a traceback per rank. Collective."""
    try:
        saved = dcp.FileSystemReader(str(source)).read_metadata().state_dict_metadata
    except Exception:  # unreadable: DCP's load says so (every rank still gathers below)
        saved = None
    problems = []
    for key, value in flatten_state_dict(state)[0].items():
        if saved is None or not isinstance(value, torch.Tensor):
            continue
        now = list(value.size())  # a ShardedTensor's or DTensor's: the whole table's
        there = saved.get(key)
        if there is None:
            problems.append(f"{_tensor_name(key)} {now} is not in it")
        elif isinstance(there, TensorStorageMetadata) and list(there.size) != now:
            problems.append(f"{_tensor_name(key)} is {list(there.size)} there, {now} here")
    problems = list(dict.fromkeys(map(str, _gather(problems))))  # in order, once each
    problems.sort(key=lambda problem: not problem.startswith("table"))  # tables first
    if problems:
        more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
        raise CheckpointError(
            f"the checkpoint {source} was written by another model: "
            + "; ".join(problems[:4]) + more + ". Resume with the model it was written "
            "with, or start over with --resume=never (the checkpoints are kept aside)"
        )  # fmt: skip


_TABLE = re.compile(r"(?:.*\.)?(?:embedding_bags|embeddings)\.(?P<table>[^.]+)\.weight")


def _tensor_name(key: str) -> str:
    """A flattened state key as a reader knows it: "table 't0'" for a table's rows, "the
    momentum1 of table 't0'" for its optimizer state, else the parameter's name in the model."""
    head, _, rest = key.partition(".")
    if head == "fused_optimizer" and rest.startswith("state."):
        fqn, _, name = rest.removeprefix("state.").rpartition(".")
        found = _TABLE.fullmatch(fqn.rpartition(".")[0])
        return f"the {name} of table {found['table']!r}" if found else f"the optimizer state {key}"
    found = _TABLE.fullmatch(rest)
    return f"table {found['table']!r}" if head == "model" and found else rest


def _found(steps: list[int], latest: bool) -> str:
    """What a checkpoint directory holds, for a message."""
    parts = []
    if steps:
        many = f"steps {steps[0]} to {steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
        parts.append(f"{len(steps)} checkpoint(s), {many}")
    if latest:
        parts.append(LATEST)
    return ", ".join(parts)
