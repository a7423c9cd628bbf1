"""`shards_pinned_as_they_are`: TorchRec's ShardedTensors of distcache's page-locked host rows.

On CUDA the rows are pinned while TorchRec's metadata says not; a CPU build cannot pin, so this
checks the mirror case (metadata pinned, shard not), which takes the same path.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)

from distcache.sharding.state import shards_pinned_as_they_are


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _build(pin_memory: bool) -> ShardedTensor:
    rows = torch.arange(12.0).reshape(4, 3)
    shard = ShardMetadata([0, 0], [4, 3], "rank:0/cpu")
    metadata = ShardedTensorMetadata(
        [shard], torch.Size([4, 3]), TensorProperties(dtype=torch.float32, pin_memory=pin_memory)
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(rows, shard)], metadata)


def test_the_shards_pin_memory_is_taken_and_the_patch_undone(one_rank):
    with pytest.raises(ValueError, match="pin_memory"):
        _build(pin_memory=True)  # torch's own check
    with shards_pinned_as_they_are():
        made = _build(pin_memory=True)
    assert made.metadata().tensor_properties.pin_memory is False
    assert torch.equal(made.local_shards()[0].tensor, torch.arange(12.0).reshape(4, 3))
    with pytest.raises(ValueError, match="pin_memory"):
        _build(pin_memory=True)  # undone


def test_other_properties_are_still_checked(one_rank):
    rows = torch.zeros(4, 3, dtype=torch.float16)
    shard = ShardMetadata([0, 0], [4, 3], "rank:0/cpu")
    properties = dataclasses.replace(TensorProperties(dtype=torch.float32), pin_memory=True)
    metadata = ShardedTensorMetadata([shard], torch.Size([4, 3]), properties)
    with shards_pinned_as_they_are(), pytest.raises(ValueError, match="dtype"):
        ShardedTensor._init_from_local_shards_and_global_metadata([Shard(rows, shard)], metadata)
