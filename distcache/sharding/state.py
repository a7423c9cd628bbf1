"""Checkpointable views of a kernel's host rows: ShardedTensors of weights and optimizer state.

They are built from each shard's TorchRec metadata alone, with no collective (a table-wise
table's kernel exists only on its owner rank), and they view the host store, so
`torch.distributed.checkpoint` reads and writes the rows in place, and can reshard them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import _remote_device
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torchrec.distributed.embedding_types import ShardedEmbeddingTable

from distcache.errors import UnsupportedError
from distcache.sharding.torchrec_private import sharded_tensor, sharded_tensor_metadata_adjusted


def _on_host(shard: ShardMetadata, local: torch.Tensor | None = None) -> ShardMetadata:
    """The shard placed where its rows live: the host store, whatever device the plan names
    (a CUDA plan places shards on `cuda:i`; distcache keeps their rows in host memory)."""
    rank = shard.placement.rank() if shard.placement is not None else 0
    device = "cpu" if local is None else local.device
    return ShardMetadata(
        list(shard.shard_offsets), list(shard.shard_sizes), _remote_device(f"rank:{rank}/{device}")
    )


def _host_metadata(
    metadata: ShardedTensorMetadata, local: torch.Tensor | None = None
) -> ShardedTensorMetadata:
    out = copy.deepcopy(metadata)
    out.shards_metadata = [_on_host(s, local) for s in metadata.shards_metadata]
    out.tensor_properties.pin_memory = False if local is None else local.is_pinned()
    if local is not None:  # the rows' own dtype (TorchRec's metadata may say fp32 for fp16)
        out.tensor_properties.dtype = local.dtype
    return out


def host_table(table: ShardedEmbeddingTable) -> ShardedEmbeddingTable:
    """A copy of the shard's table config whose metadata places it in host memory."""
    out = copy.copy(table)
    if table.local_metadata is not None:
        out.local_metadata = _on_host(table.local_metadata)
    if table.global_metadata is not None:
        out.global_metadata = _host_metadata(table.global_metadata)
    return out


def sharded_weight(
    table: ShardedEmbeddingTable, local: torch.Tensor, pg: dist.ProcessGroup | None
) -> ShardedTensor:
    """The table's weights `[num_embeddings, dim]`, this rank holding `local` (a view)."""
    return sharded_tensor(
        [Shard(local, _on_host(table.local_metadata, local))],
        _host_metadata(table.global_metadata, local),
        process_group=pg,
    )


def sharded_state(
    table: ShardedEmbeddingTable, local: torch.Tensor, pg: dist.ProcessGroup | None
) -> ShardedTensor:
    """The table's optimizer state, this rank holding `local` `[local_rows, state_width]`.

    Layout: the state of the shards of column group g (shards sorted by column offset) sits at
    rows `[g * num_embeddings + row_offset, ...)`, so a row-sharded table's state is simply
    `[num_embeddings, state_width]`, sharded by rows like its weights (and reshards between
    table-, row- and table-row-wise plans), while column-wise shards, whose states differ per
    column group (row-wise Adagrad sums over the shard's own columns), are stacked (as TorchRec
    stacks them); those reload into the same column split.

    Raises:
        UnsupportedError: column groups of different widths with a per-column state.
    """
    width = local.shape[1]
    shards = table.global_metadata.shards_metadata
    col_offsets = sorted({s.shard_offsets[1] for s in shards})
    group = {offset: g for g, offset in enumerate(col_offsets)}
    per_column = width != 1  # element-wise moments scale with the shard's columns
    if per_column and len({s.shard_sizes[1] for s in shards}) > 1:
        raise UnsupportedError(
            f"table {table.name!r}: column shards of different widths "
            f"{sorted({s.shard_sizes[1] for s in shards})} with a per-column optimizer state "
            "cannot be checkpointed yet; split columns evenly or use row-wise Adagrad or SGD"
        )

    def state_shard(s: ShardMetadata) -> ShardMetadata:
        row = group[s.shard_offsets[1]] * table.num_embeddings + s.shard_offsets[0]
        return _on_host(ShardMetadata([row, 0], [s.shard_sizes[0], width], s.placement), local)

    metadata = ShardedTensorMetadata(
        shards_metadata=[state_shard(s) for s in shards],
        size=torch.Size([len(col_offsets) * table.num_embeddings, width]),
        tensor_properties=copy.deepcopy(table.global_metadata.tensor_properties),
    )
    metadata.tensor_properties.requires_grad = False
    metadata.tensor_properties.pin_memory = local.is_pinned()
    metadata.tensor_properties.dtype = local.dtype  # float32, whatever the rows' dtype
    return sharded_tensor(
        [Shard(local, state_shard(table.local_metadata))], metadata, process_group=pg
    )


@contextlib.contextmanager
def shards_pinned_as_they_are() -> Iterator[None]:
    """While TorchRec builds a sharded module's state: every ShardedTensor made from local shards
    takes `pin_memory` from its shards, not from the metadata.

    TorchRec builds each table's ShardedTensor with default tensor properties (not pinned),
    and torch checks the local shards against them; on CUDA distcache's shards view page-locked
    host rows, which are pinned. Only that property is taken; torch checks every other.
    TorchRec has no per-table hook there, so torch's classmethod is swapped for the call (the
    module's construction, on one thread) and put back after it, whatever happens."""

    def adjust(local_shards: list[Shard], metadata: ShardedTensorMetadata) -> ShardedTensorMetadata:
        pinned = {shard.tensor.is_pinned() for shard in local_shards}
        properties = metadata.tensor_properties
        if len(pinned) == 1 and properties.pin_memory not in pinned:
            metadata = copy.copy(metadata)
            metadata.tensor_properties = dataclasses.replace(properties, pin_memory=pinned.pop())
        return metadata

    with sharded_tensor_metadata_adjusted(adjust):
        yield
