"""torchx component of the distcache training job.

Usage (from the repository root, with the venv's `torchrun` on PATH)::

    torchx run -s local_cwd launch/components.py:train --nproc 2 -- --train.steps=100
    torchx run -s local_cwd launch/components.py:train --config configs/criteo_kaggle.toml \\
        --nnodes 2 --nproc 8 --gpu 8

The arguments after `--` are config overrides (`--section.key=value`), `--resume` or `--debug`.
"""

from typing import Dict, Optional  # noqa: UP035 (torchx 0.7 reads these names)

import torchx.specs as specs
from torchx.components.dist import ddp


def train(
    *overrides: str,
    config: str = "configs/tiny_cpu.toml",
    nnodes: int = 1,
    nproc: int = 2,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,  # noqa: N803 (torchx's name)
    max_restarts: int = 0,
    image: str = ".",
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP007, UP045
) -> specs.AppDef:
    """Train a DLRM with distcache's look-ahead caches (`python -m distcache train`).

    Args:
        overrides: config overrides, `--section.key=value`, or `--resume`
        config: the job's TOML config
        nnodes: nodes
        nproc: processes (ranks) per node
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node, MB
        max_restarts: restarts of a failed worker group (resuming from the latest checkpoint
            needs `--resume` in overrides)
        image: the image (for local_cwd: the working directory)
        env: extra environment variables
    """
    return ddp(
        "train",
        "--config",
        config,
        *overrides,
        m="distcache",
        image=image,
        name="distcache-train",
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=f"{nnodes}x{nproc}",
        max_retries=max_restarts,
        env={"OMP_NUM_THREADS": "1", **(env or {})},
    )
