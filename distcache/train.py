"""`python -m distcache train`: train a TorchRec DLRM with look-ahead caches from a TOML config.

config -> data -> DLRM -> plan -> DistributedModelParallel with distcache's sharder ->
`LookaheadTrainPipeline` -> the training loop. Each step is a component of `distcache.job`:
config (`config`), process group (`distributed`), model and plan (`placement`), checkpoints
(`checkpoint`), the loop (`trainer`). Run it under torchrun (or torchx) for several ranks;
alone, it is one rank.

Example::

    torchrun --nproc-per-node 2 -m distcache train --config configs/tiny_cpu.toml \\
        --train.steps=200 --cache.capacity=0.02
"""

from __future__ import annotations

import logging
import sys

import torch

from distcache.data.sources import JobData
from distcache.job.check import check_inputs
from distcache.job.checkpoint import Checkpointer
from distcache.job.config import JobConfig, parse_args, write_resolved_config
from distcache.job.distributed import process_group
from distcache.job.dlrm import dense_optimizer
from distcache.job.placement import build_model, shard_model
from distcache.job.trainer import Trainer
from distcache.pipeline import LookaheadTrainPipeline

log = logging.getLogger("distcache.train")


def main(argv: list[str] | None = None) -> int:
    """Train as `argv` (default: the command line) says; returns the exit status."""
    config = parse_args(list(sys.argv[1:] if argv is None else argv))
    check_inputs(config)
    with process_group(config.train.device) as (rank, world, device):
        # (In a function of its own: the model, the pipeline and their process groups are
        # released when it returns, before the group is torn down: `process_group`.)
        _train(config, rank, world, device)
    return 0


def _train(config: JobConfig, rank: int, world: int, device: torch.device) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
        force=True,
    )
    logging.captureWarnings(True)  # warnings too, with their level, above the progress bar
    # TorchRec logs a dozen INFO lines per rank while sharding: its warnings are enough.
    logging.getLogger("torchrec").setLevel(logging.WARNING)
    checkpoints = Checkpointer(
        config.checkpoint_dir, config.checkpoint.every, keep_last=config.checkpoint.keep_last
    )
    resume = config.checkpoint
    if not resume.resume and checkpoints.every:  # never overwrite what this run did not load
        checkpoints.guard_fresh_start(start_over=resume.start_over)
    if rank == 0:
        write_resolved_config(config)
    data = JobData(config.data, steps=config.train.steps, rank=rank, world_size=world)
    model = shard_model(config, build_model(config, data), data, world, device)
    lr = config.train.dense_learning_rate
    dense = dense_optimizer(model, lambda params: torch.optim.SGD(params, lr=lr))
    start = 0
    if resume.resume:
        start = checkpoints.restore(model, dense, require=resume.require) or 0
    # The pipeline's look-ahead L and staging depth K: the caches' own.
    skip_nonfinite = config.train.on_nonfinite == "skip"
    pipeline = LookaheadTrainPipeline(model, dense, device, skip_nonfinite=skip_nonfinite)
    trainer = Trainer(config, model, pipeline, data, checkpoints, dense, rank, world, device)
    summary = trainer.fit(start)
    if rank == 0:
        log.info("done: %s", summary)


if __name__ == "__main__":
    raise SystemExit(main())
