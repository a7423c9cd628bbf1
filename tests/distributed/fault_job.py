"""The training job with faults injected, for tests/distributed/test_faults.py (torchrun runs
this file instead of `-m distcache train`; the arguments are the job's).

Environment:
    FAULT_BATCH   "<step>:<rank>:<kind>": that rank's training batch of that step is
                  nan   (a NaN in its dense features: the batch check catches it),
                  nanloss (its loss comes out NaN, as when a model diverges: the batch is
                        fine, so the check lets it through), or
                  drop  (removed from the data, on every rank: a clean run that never saw it;
                        rank is ignored).
    FAULT_SAVE    "<step>:<rank>": that rank exits while the checkpoint of that step is being
                  written (after its files, before the checksums and `latest.json`), on the
                  first torchrun attempt only.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

import distcache.job.checkpoint as checkpoint
import distcache.train
from distcache.__main__ import main
from distcache.data.sources import JobData


def _poison(batch, kind: str):  # noqa: ANN001, ANN202
    batch.dense_features = torch.full_like(batch.dense_features, float("nan"))
    return batch


def _nan_loss_at(step: int, rank: int) -> None:
    """The model's training loss of batch `step` on `rank` is NaN (forward number `step`: the
    fault runs train from step 0 and evaluate in eval mode)."""
    original = distcache.train.build_model
    calls = itertools.count()

    def nan_loss(module, args, output):  # noqa: ANN001, ANN202
        if not module.training or next(calls) != step or os.environ.get("RANK", "0") != str(rank):
            return output
        loss, rest = output
        return loss * float("nan"), rest

    def build_model(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        model = original(*args, **kwargs)
        model.register_forward_hook(nan_loss)
        return model

    distcache.train.build_model = build_model


def _inject_batch(spec: str) -> None:
    step, rank, kind = spec.split(":")
    step, rank = int(step), int(rank)
    if kind == "nanloss":
        _nan_loss_at(step, rank)
        return
    original = JobData.train_batches

    def train_batches(self: JobData, start: int = 0) -> Iterator:
        if kind == "drop":  # the synthetic data without batch `step`: later ones move up one
            indices = (i for i in itertools.count(start) if i != step)
            if start >= step:
                indices = itertools.count(start + 1)
            return (self._log.batch(i) for i in itertools.islice(indices, self.steps - start))
        if self.rank != rank:
            return original(self, start)
        return (
            _poison(batch, kind) if i == step else batch
            for i, batch in enumerate(original(self, start), start)
        )

    JobData.train_batches = train_batches


def _inject_save(spec: str) -> None:
    step, rank = map(int, spec.split(":"))
    original = checkpoint._write_manifest

    def write_manifest(directory: Path) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first_attempt
            and directory.name == f"step_{step:08d}"
            and os.environ.get("RANK", "0") == str(rank)
        ):
            print(f"fault injection: rank {rank} exits while saving step {step}", flush=True)
            os._exit(13)
        original(directory)

    checkpoint._write_manifest = write_manifest


def _report_threads_at_exit() -> None:
    """At the interpreter's shutdown (atexit), this rank's OS threads by name (Linux): a
    process group the job left alive keeps gloo's threads ('pt_gloo_runloop', 'gloo_tcp_loop')
    running into the shutdown, where one of them can abort the finished rank."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            names.append((task / "comm").read_text().strip())
    line = f"rank {os.environ.get('RANK', '0')}: threads at exit: {sorted(names)}\n"
    os.write(2, line.encode())  # one write: the ranks share the pipe (print writes twice)


if __name__ == "__main__":
    atexit.register(_report_threads_at_exit)
    if "FAULT_BATCH" in os.environ:
        _inject_batch(os.environ["FAULT_BATCH"])
    if "FAULT_SAVE" in os.environ:
        _inject_save(os.environ["FAULT_SAVE"])
    sys.exit(main(["train", *sys.argv[1:]]))
