"""Checkpointable views of a kernel's host rows: ShardedTensors of weights and optimizer state.

They are built from each shard's TorchRec metadata alone, with no collective (a table-wise
table's kernel exists only on its owner rank), and they view the host store, so
`torch.distributed.checkpoint` reads and writes the rows in place, and can reshard them.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torchrec.distributed.embedding_types import ShardedEmbeddingTable


def sharded_weight(
    table: ShardedEmbeddingTable, local: torch.Tensor, pg: dist.ProcessGroup | None
) -> ShardedTensor:
    """The table's weights `[num_embeddings, dim]`, this rank holding `local` (a view)."""
    metadata = copy.deepcopy(table.global_metadata)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(local, table.local_metadata)], metadata, process_group=pg
    )


def sharded_state(
    table: ShardedEmbeddingTable, local: torch.Tensor, pg: dist.ProcessGroup | None
) -> ShardedTensor:
    """The table's optimizer state `[num_embeddings, state_dim]`, sharded by rows like the
    weights; this rank holds `local` `[local_rows, state_dim]` (a view of the host store).

    Raises:
        NotImplementedError: the table is column-wise sharded, so its shards' states overlap
            in rows and need a layout of their own.
    """
    width = local.shape[1]
    shards = table.global_metadata.shards_metadata
    if any(s.shard_sizes[1] != table.embedding_dim for s in shards):
        raise NotImplementedError(
            f"table {table.name!r}: checkpointing the optimizer state of column-wise shards is "
            "not supported yet; use table-, row- or table-row-wise sharding, or SGD"
        )

    def state_shard(s: ShardMetadata) -> ShardMetadata:
        return ShardMetadata([s.shard_offsets[0], 0], [s.shard_sizes[0], width], s.placement)

    metadata = ShardedTensorMetadata(
        shards_metadata=[state_shard(s) for s in shards],
        size=torch.Size([table.num_embeddings, width]),
        tensor_properties=copy.deepcopy(table.global_metadata.tensor_properties),
    )
    metadata.tensor_properties.requires_grad = False
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(local, state_shard(table.local_metadata))], metadata, process_group=pg
    )
