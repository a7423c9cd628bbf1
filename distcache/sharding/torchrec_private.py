"""TorchRec's and torch's private attributes that distcache reads or sets, each behind one small
function: a release that renames one breaks here, in one file, and nowhere else.

Read from TorchRec 1.8.0 (torch 2.13). The GPU machine runs TorchRec 1.6.1, where every name
below is the same; a function here does exactly the access it names, nothing more, so it
behaves as the inline access it replaces on both.

Not here: what distcache's subclasses of TorchRec's classes use as their own (`self._lookups`,
`self._embedding_shardings`, `self._output_dists`, ... in `sharded_module.py`) and the private
methods they override (`_create_lookups`, `_initialize_torch_state`, `_create_embedding_kernel`):
that is the subclassing contract, and it reads best where the subclass is.
`tests/unit/sharding/test_torchrec_private.py` checks that no other module of the package
touches the names this module covers.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torchrec.distributed.embedding_sharding import EmbeddingSharding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# --- compute kernels (`BaseBatchedEmbedding` and its subclasses) -----------------------------


def kernel_config(kernel: torch.nn.Module) -> GroupedEmbeddingConfig:
    """The group of table shards a kernel serves (`_config`; distcache's kernels set it to the
    group described in host memory)."""
    return kernel._config


def kernel_process_group(kernel: torch.nn.Module) -> dist.ProcessGroup | None:
    """The process group TorchRec built the kernel with (`_pg`)."""
    return kernel._pg


def mark_updated_in_backward(param: torch.Tensor) -> None:
    """Mark a table's parameter as updated by a fused optimizer in backward
    (`_in_backward_optimizers`), so that TorchRec's `in_backward_optimizer_filter` leaves it
    out of the dense optimizer's parameters, as it does for TorchRec's own fused kernels."""
    param._in_backward_optimizers = [EmptyFusedOptimizer()]


# --- shardings (`EmbeddingSharding` and its subclasses) --------------------------------------


def sharding_process_group(sharding: EmbeddingSharding) -> dist.ProcessGroup:
    """The process group of a sharding's all-to-alls (`_pg`)."""
    return sharding._pg


def sharding_env(sharding: EmbeddingSharding) -> ShardingEnv:
    """The sharding's world (`_env`)."""
    return sharding._env


def sharding_device(sharding: EmbeddingSharding) -> torch.device | None:
    """The device the sharding was built for (`_device`)."""
    return sharding._device


def emb_dim_per_rank_per_feature(sharding: EmbeddingSharding) -> list[list[int]]:
    """Per rank, the embedding width of each feature it serves
    (`_emb_dim_per_rank_per_feature()`): what a pooled output all-to-all splits by."""
    return sharding._emb_dim_per_rank_per_feature()


def grouped_configs(sharding: EmbeddingSharding) -> list[GroupedEmbeddingConfig]:
    """This rank's groups of table shards (`_grouped_embedding_configs`; table-row-wise keeps
    them per rank, in `_grouped_embedding_configs_per_rank[_rank]`)."""
    if isinstance(sharding, TwRwPooledEmbeddingSharding):
        return sharding._grouped_embedding_configs_per_rank[sharding._rank]
    return sharding._grouped_embedding_configs


# --- output distributions --------------------------------------------------------------------


def output_dist_codecs(output_dist: torch.nn.Module) -> Any:
    """The quantized-comms codecs of a pooled output dist (`_codecs`), or None."""
    return getattr(output_dist, "_codecs", None)


def output_dist_callbacks(output_dist: torch.nn.Module) -> Any:
    """The callbacks a pooled output dist runs on its result (`_callbacks`), or None."""
    return getattr(output_dist, "_callbacks", None)


# --- KeyedJaggedTensor -----------------------------------------------------------------------


def with_values(features: KeyedJaggedTensor, values: torch.Tensor) -> KeyedJaggedTensor:
    """A shallow copy of `features` with other `values` of the same shape (`_values`), its
    cached per-key split (`_jt_dict`) dropped; `features` itself is left as it was."""
    out = copy.copy(features)
    out._values = values
    out._jt_dict = None
    return out


# --- torch's ShardedTensor -------------------------------------------------------------------


def sharded_tensor(
    local_shards: list[Shard],
    metadata: ShardedTensorMetadata,
    process_group: dist.ProcessGroup | None = None,
) -> ShardedTensor:
    """A ShardedTensor of this rank's `local_shards` and the global `metadata`, with no
    collective (`ShardedTensor._init_from_local_shards_and_global_metadata`)."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=process_group
    )


@contextlib.contextmanager
def sharded_tensor_metadata_adjusted(
    adjust: Callable[[list[Shard], ShardedTensorMetadata], ShardedTensorMetadata],
) -> Iterator[None]:
    """While inside, every ShardedTensor made from local shards
    (`ShardedTensor._init_from_local_shards_and_global_metadata`, a classmethod) is made with
    `adjust(local_shards, metadata)` in place of `metadata`; the classmethod is put back on
    exit, whatever happens. For a call where TorchRec builds ShardedTensors with no hook of its
    own; the swap is seen by every thread, so the call must run on one."""
    original = ShardedTensor.__dict__["_init_from_local_shards_and_global_metadata"]

    # TorchRec passes both by keyword: the wrapper keeps torch's parameter names.
    def init(cls, local_shards, sharded_tensor_metadata, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        adjusted = adjust(local_shards, sharded_tensor_metadata)
        return original.__func__(cls, local_shards, adjusted, *args, **kwargs)

    ShardedTensor._init_from_local_shards_and_global_metadata = classmethod(init)
    try:
        yield
    finally:
        ShardedTensor._init_from_local_shards_and_global_metadata = original
