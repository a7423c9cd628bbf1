"""The training loop of a job: pipeline steps, metrics, evaluation, checkpoints.

Training runs in segments between checkpoints. A segment streams its batches through the
`LookaheadTrainPipeline`, which drains its window at the segment's end, so a checkpoint sees
every update (the caches are flushed into it) and a resumed job replays exactly the steps an
uninterrupted one takes. Evaluations run between two steps, the window full: the model in eval
mode reads its rows beside the window (`CachedEmbeddingBags.forward`), after every batch
before the evaluation's step trained and before any after it.

Rank 0 logs loss, AUC (torchmetrics, over every rank's samples), samples/s and the caches'
hit rate, loads and critical-path misses; it appends each record to `<run dir>/metrics.jsonl`,
and optionally to TensorBoard.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torchmetrics.functional.classification import binary_auroc

from distcache.cache.counters import LOGGED
from distcache.data.criteo import feature_names
from distcache.data.sources import JobData
from distcache.errors import DistcacheConfigError, NonFiniteError
from distcache.job.batches import BatchSpec, CheckedBatches, host_group
from distcache.job.checkpoint import Checkpointer
from distcache.job.config import JobConfig, dump_toml
from distcache.pipeline import LookaheadTrainPipeline

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

log = logging.getLogger("distcache.train")

#: Fault injection for tests: the rank `DISTCACHE_CRASH_RANK` (default 1) exits after training
#: step `DISTCACHE_CRASH_AT_STEP`, on the first attempt of a torchrun job only.
CRASH_AT_STEP = "DISTCACHE_CRASH_AT_STEP"
CRASH_RANK = "DISTCACHE_CRASH_RANK"
#: With `[train] on_nonfinite = "skip"`, this many skipped steps in a row stop the job: the
#: model itself is broken, not a batch.
MAX_NONFINITE_IN_A_ROW = 20


def metrics_line(kind: str, record: dict[str, object]) -> str:
    """One `metrics.jsonl` line: strict JSON, a non-finite value written as null."""
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps({"kind": kind, **finite}, allow_nan=False) + "\n"


def run_header(config: JobConfig, start: int, world_size: int) -> dict[str, object]:
    """The record that opens each run's lines in `metrics.jsonl` (a run directory collects the
    lines of every run and resume): a run id, where it starts, and the resolved config's hash."""
    import distcache

    digest = hashlib.sha256(dump_toml(config).encode()).hexdigest()[:16]
    return {
        "run_id": uuid.uuid4().hex[:12],
        "start_step": start,
        "world_size": world_size,
        "config_sha256": digest,
        "distcache": distcache.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _gather_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's tensors concatenated (sizes may differ between ranks)."""
    local = torch.cat(tensors) if tensors else torch.zeros(0)
    parts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.detach().float().cpu())
    return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])


def _auc(logits: list[torch.Tensor], labels: list[torch.Tensor]) -> float:
    preds, target = _gather_cat(logits), _gather_cat(labels)
    if target.numel() == 0 or target.min() == target.max():
        return float("nan")
    return float(binary_auroc(torch.sigmoid(preds), target.long()))


class Trainer:
    """Trains a sharded model through a `LookaheadTrainPipeline` for `config.train.steps`."""

    def __init__(
        self,
        config: JobConfig,
        model: torch.nn.Module,
        pipeline: LookaheadTrainPipeline,
        data: JobData,
        checkpoints: Checkpointer,
        dense_optimizer: torch.optim.Optimizer,
        rank: int,
        world_size: int,
        device: torch.device,
    ):
        self.config, self.model, self.pipeline, self.data = config, model, pipeline, data
        self.checkpoints, self.dense_optimizer = checkpoints, dense_optimizer
        self.rank, self.world_size, self.device = rank, world_size, device
        self.run_dir = Path(config.run.dir)
        self._writer: SummaryWriter | None = None
        if config.train.tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._window: dict[str, list[torch.Tensor]] = {"loss": [], "logits": [], "labels": []}
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._samples = 0
        self._eval_critical = 0  # evaluation looks rows up unannounced: not training's misses
        self._last: dict[str, float] = {}
        self._finite = torch.ones((), dtype=torch.bool, device=device)  # every loss so far
        self._spec = BatchSpec(
            features=tuple(feature_names(len(data.table_sizes))),
            rows=tuple(data.table_sizes),
            dense_features=data.dense_features,
            weighted=config.data.weighted,
        )
        self._skip_bad = config.data.on_bad_batch == "skip"
        self._host_group = host_group() if self._skip_bad else None
        self._skipped = {"bad_batches": 0, "nonfinite_skipped": 0}  # since the last log
        self._nonfinite_in_a_row = 0

    # ------------------------------------------------------------ loop
    def fit(self, start: int = 0) -> dict[str, float]:
        """Train steps `start .. steps - 1`; returns the last logged metrics and evaluation."""
        bar = self._progress_bar(start)
        redirect: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if bar is not None:
            from tqdm.contrib.logging import logging_redirect_tqdm

            redirect = logging_redirect_tqdm()  # log lines above the bar, not on it
        with redirect:
            return self._fit(start, bar)

    def _fit(self, start: int, bar: tqdm | None) -> dict[str, float]:
        cfg = self.config.train
        if self.rank == 0:
            header = run_header(self.config, start, self.world_size)
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(metrics_line("run", header))
        step = start
        while step < cfg.steps:
            end = self._segment_end(step)
            batches = CheckedBatches(
                itertools.islice(self.data.train_batches(step), end - step),
                self._spec,
                first=step,
                skip=self._skip_bad,
                group=self._host_group,
            )
            last = step  # the step of the last batch trained (at first: evaluated before)
            while True:
                skipped = self.pipeline.skipped_nonfinite
                try:
                    loss, logits, labels = self.pipeline.progress(batches)
                except StopIteration:
                    break
                step += 1
                last = batches.read.popleft()
                if batches.read:  # (else the segment's end evaluates)
                    self._evaluate_between(last, batches.read[0])
                if self.pipeline.skipped_nonfinite == skipped:
                    self._record(loss, logits, labels)
                else:
                    self._count_nonfinite(step)
                self._maybe_crash(step)
                if bar is not None:
                    bar.update(1)
                if cfg.log_every and step % cfg.log_every == 0:
                    self.log_metrics(step)
            step += batches.skipped  # skipped batches are steps of the data too
            self._skipped["bad_batches"] += batches.skipped
            if bar is not None:
                bar.update(batches.skipped)
            if step < end:
                raise DistcacheConfigError(
                    f"the data ran out at step {step} of [train] steps = {cfg.steps} "
                    f"(rank {self.rank}): use fewer steps or more data"
                )
            self._evaluate_between(last, end)
            if self.checkpoints.due(step) and step < cfg.steps:
                self._save(step)
        if bar is not None:
            bar.close()
        if self._window_steps:
            self.log_metrics(step)
        self.evaluate(step)
        if self.checkpoints.every:
            self._save(step)
        return dict(self._last)

    def _save(self, step: int) -> None:
        """A checkpoint of `step`, unless a loss or dense parameter so far was not finite on
        any rank: then the job stops (every rank alike) and `latest` keeps the last good one."""
        finite = self._finite.clone()
        for p in self.model.parameters():
            if p.is_floating_point() and p.device == self.device:
                finite &= torch.isfinite(p.detach()).all()
        flag = finite.to(torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not bool(flag):  # one read per checkpoint, not per step
            last = self.checkpoints.latest()
            raise NonFiniteError(
                f"a loss or dense parameter became NaN or infinite before step {step}; no "
                "checkpoint of it was written ("
                + (f"the last good one is step {last}" if last is not None else "none before it")
                + "). Lower the learning rates or check the data"
            )
        self.checkpoints.save(step, self.model, self.dense_optimizer)

    def _count_nonfinite(self, step: int) -> None:
        self._skipped["nonfinite_skipped"] += 1
        self._nonfinite_in_a_row += 1
        log.warning("skipped step %d: its loss was NaN or infinite on some rank", step)
        if self._nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
            raise NonFiniteError(
                f"the loss was NaN or infinite in {MAX_NONFINITE_IN_A_ROW} steps in a row (up "
                f"to step {step}): the model itself has diverged. Lower the learning rates, "
                "and resume from the last checkpoint"
            )

    def _segment_end(self, step: int) -> int:
        """The next step at which the window drains: a checkpoint or the end."""
        every = self.checkpoints.every
        return min(self.config.train.steps, (step // every + 1) * every if every else math.inf)

    def _evaluate_between(self, last: int, upcoming: int) -> None:
        """Evaluate at each `eval_every` step in (`last`, `upcoming`]: after the batch of step
        `last` trained and before that of step `upcoming` (skipped batches between them), the
        last step excepted (`_fit` evaluates it at the end)."""
        every, steps = self.config.train.eval_every, self.config.train.steps
        if every:
            for step in range((last // every + 1) * every, min(upcoming, steps - 1) + 1, every):
                self.evaluate(step)

    # ------------------------------------------------------------ metrics
    def _record(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self._nonfinite_in_a_row = 0
        self._window["loss"].append(loss.detach().float().reshape(()))
        self._finite &= torch.isfinite(self._window["loss"][-1])  # on the device: no read
        self._window["logits"].append(logits.detach().reshape(-1))
        self._window["labels"].append(labels.detach().reshape(-1))
        self._window_steps += 1
        self._samples += labels.numel()

    def log_metrics(self, step: int) -> dict[str, float]:
        """Loss, AUC and samples/s of the steps since the last log, every rank's together, and
        the caches' counters (summed over ranks). Collective."""
        elapsed = time.perf_counter() - self._window_start
        losses = self._window["loss"] or [torch.full((), float("nan"), device=self.device)]
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss)
        auc = _auc(self._window["logits"], self._window["labels"])
        cache = self.pipeline.stats()["total"]
        cache["critical_misses"] -= self._eval_critical
        names = ("hits", "unique", *LOGGED, "wait_s", "step_s")
        counters = [self._samples, *(cache[k] for k in names)]  # on the device: nccl's too
        counters = torch.tensor(counters, dtype=torch.float64, device=self.device)
        dist.all_reduce(counters)
        samples, *values = counters.tolist()
        summed = dict(zip(names, values, strict=True))
        record = {
            "step": step,
            "loss": float(loss) / self.world_size,
            "auc": auc,
            "samples_per_s": samples / elapsed if elapsed > 0 else float("nan"),
            "hit_rate": summed["hits"] / summed["unique"] if summed["unique"] else float("nan"),
            **{k: summed[k] for k in LOGGED},
            "wait_fraction": summed["wait_s"] / summed["step_s"] if summed["step_s"] else 0.0,
        }
        if self._skip_bad or self.config.train.on_nonfinite == "skip":
            record.update(self._skipped)  # the same on every rank: the ranks skip together
        self._emit("train", record)
        self._skipped = dict.fromkeys(self._skipped, 0)
        self._window = {"loss": [], "logits": [], "labels": []}
        self._window_start, self._window_steps, self._samples = time.perf_counter(), 0, 0
        return record

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Loss and AUC on the held-out batches, the model in eval mode (read beside the
        pipeline's window, if it holds batches). Collective."""
        batches = self.data.eval_batches()
        if not batches:
            return {}
        self.model.eval()
        critical = self.pipeline.stats()["total"]["critical_misses"]
        losses, logits, labels = [], [], []
        for batch in batches:
            _, (loss, out, target) = self.model(batch.to(self.device))
            losses.append(loss.reshape(()))
            logits.append(out.reshape(-1))
            labels.append(target.reshape(-1))
        self.model.train()
        self._eval_critical += self.pipeline.stats()["total"]["critical_misses"] - critical
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss)
        record = {
            "step": step,
            "eval_loss": float(loss) / self.world_size,
            "eval_auc": _auc(logits, labels),
        }
        self._emit("eval", record)
        return record

    def _emit(self, kind: str, record: dict[str, float]) -> None:
        self._last.update(record)
        if self.rank != 0:
            return
        text = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
        )
        log.info("%s: %s", kind, text)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(metrics_line(kind, record))
        if self._writer is not None:
            for key, value in record.items():
                if key != "step":
                    self._writer.add_scalar(f"{kind}/{key}", value, record["step"])

    # ------------------------------------------------------------ misc
    def _progress_bar(self, start: int) -> tqdm | None:
        """Rank 0's progress bar, on a terminal only (into a file it would write a line of
        carriage-return-separated updates between the log lines)."""
        if self.rank != 0 or not self.config.train.progress_bar or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=self.config.train.steps, initial=start, unit="step", desc="train")

    def _maybe_crash(self, step: int) -> None:
        at = os.environ.get(CRASH_AT_STEP)
        if at is None or int(at) != step:
            return
        if self.rank != int(os.environ.get(CRASH_RANK, "1")):
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return  # crash once; the restarted attempt runs through
        log.error("fault injection: rank %d exits after step %d", self.rank, step)
        os._exit(13)
