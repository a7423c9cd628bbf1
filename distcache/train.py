"""`python -m distcache train`: train a TorchRec DLRM with look-ahead caches from a TOML config.

config -> data -> DLRM -> plan -> DistributedModelParallel with distcache's sharder ->
`LookaheadTrainPipeline` -> the training loop (`distcache.job.trainer`). Run it under torchrun (or
torchx) for several ranks; alone, it is one rank.

Example::

    torchrun --nproc-per-node 2 -m distcache train --config configs/tiny_cpu.toml \\
        --train.steps=200 --cache.capacity=0.02
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan

from distcache.cache.config import CacheConfig
from distcache.data.sources import JobData
from distcache.errors import DistcacheConfigError
from distcache.job import dlrm
from distcache.job.checkpoint import Checkpointer
from distcache.job.config import JobConfig, dump_toml, load_job_config
from distcache.job.placement import job_sharding_plan
from distcache.job.trainer import Trainer
from distcache.pipeline import LookaheadTrainPipeline

log = logging.getLogger("distcache.train")


def parse_args(argv: list[str]) -> tuple[JobConfig, argparse.Namespace]:
    """The job config from `--config FILE`, `--resume` and `--section.key=value` overrides."""
    parser = argparse.ArgumentParser(
        prog="python -m distcache train",
        description="Train a DLRM with distcache's look-ahead caches.",
        epilog="Any config key can be overridden: --section.key=value (TOML values).",
    )
    parser.add_argument("--config", help="TOML job config (default: all defaults)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "." in o.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognized arguments {bad}: overrides are --section.key=value")
    config = load_job_config(args.config, overrides)
    if args.resume:
        config = dataclasses.replace(
            config, checkpoint=dataclasses.replace(config.checkpoint, resume=True)
        )
    return config, args


def check_inputs(config: JobConfig) -> None:
    """Errors a job can know before any process starts: missing files, missing packages."""
    for path in config.data.paths + config.data.eval_paths:
        if not Path(path).exists():
            raise DistcacheConfigError(f"[data] path {path!r} does not exist")
    planner = config.plan.planner
    if planner.endswith(".json") and not Path(planner).is_file():
        raise DistcacheConfigError(f"[plan] planner file {planner!r} does not exist")
    if config.train.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError as err:
            raise DistcacheConfigError(
                "[train] tensorboard = true needs the tensorboard package: pip install tensorboard"
            ) from err
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise DistcacheConfigError("[train] device = 'cuda' but CUDA is not available here")


@contextlib.contextmanager
def process_group(device_type: str) -> Iterator[tuple[int, int, torch.device]]:
    """This process's rank, world size and device; under torchrun from its environment, else
    a one-rank group."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=int(os.environ.get("DISTCACHE_PG_TIMEOUT_S", "300")))
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _attempt_store(rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    try:
        yield rank, world, device
    finally:
        dist.destroy_process_group()


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, with keys private to this attempt: after a restart (`--max-restarts`)
    torchrun may hand the new workers the same store, whose keys from the failed attempt
    would make gloo connect to dead peers and hang."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distcache/attempt_{attempt}", store)


def cache_config(config: JobConfig) -> CacheConfig:
    c = config.cache
    return CacheConfig(
        capacity=c.capacity,
        lookahead=c.lookahead,
        prefetch_depth=c.prefetch_depth,
        policy=c.policy,
        optimizer=c.optimizer,
        learning_rate=c.learning_rate,
    )


def build_model(config: JobConfig, rows: tuple[int, ...], dense_in: int) -> torch.nn.Module:
    m = config.model
    model = dlrm.build_dlrm(
        dlrm.DLRMConfig(
            rows=rows,
            dim=m.embedding_dim,
            dense_in_features=dense_in,
            dense_hidden=tuple(m.bottom_mlp[:-1]),
            over_hidden=tuple(m.top_mlp[:-1]),
        ),
        seed=config.data.seed,
    )
    dlrm.apply_embedding_optimizer(model, config.cache.optimizer, lr=config.cache.learning_rate)
    return model


def shard(
    config: JobConfig, model: torch.nn.Module, data: JobData, world: int, device: torch.device
) -> DistributedModelParallel:
    """The model under DMP, placed by the configured planner (`distcache.job.placement`)."""
    sharder = dlrm.cached_sharder(
        data.table_sizes,
        cache_config(config),
        world_size=world,
        batch_size=config.data.batch_size,
        ids_per_sample=data.max_ids_per_sample,
    )
    plan: ShardingPlan = job_sharding_plan(config, model, data, sharder, world, device)
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=device,
        plan=plan,
        sharders=[sharder],
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config, _ = parse_args(argv)
    check_inputs(config)
    with process_group(config.train.device) as (rank, world, device):
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s",
            force=True,
        )
        run_dir = Path(config.run.dir)
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "resolved_config.toml").write_text(dump_toml(config))
        data = JobData(config.data, steps=config.train.steps, rank=rank, world_size=world)
        model = build_model(config, data.table_sizes, data.dense_features)
        dmp = shard(config, model, data, world, device)
        dense = dlrm.dense_optimizer(
            dmp, lambda params: torch.optim.SGD(params, lr=config.train.dense_learning_rate)
        )
        checkpoints = Checkpointer(config.checkpoint_dir, config.checkpoint.every)
        start = (checkpoints.restore(dmp, dense) if config.checkpoint.resume else None) or 0
        pipeline = LookaheadTrainPipeline(
            dmp,
            dense,
            device,
            lookahead=None,
            prefetch_depth=None,
        )
        trainer = Trainer(config, dmp, pipeline, data, checkpoints, dense, rank, world, device)
        summary = trainer.fit(start)
        if rank == 0:
            log.info("done: %s", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
