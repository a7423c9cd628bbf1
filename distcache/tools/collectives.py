"""Bytes a rank sends to other ranks in collectives, counted as they are dispatched: what
`compare --measure` reports beside the cost model's `all_to_all_sent_bytes`.

Example::

    with CollectiveBytes() as counted:
        pipeline.progress(batches)
    print(counted.all_to_all, counted.all_reduce)
"""

from __future__ import annotations

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank sends to other ranks in the collectives dispatched while it
    is active (c10d's ops, as TorchRec and DDP issue them on gloo, and the functional
    all-to-all of distcache's compact output dist):

    - all-to-all: the input but the rows the rank keeps (its own split);
    - reduce-scatter: (W - 1) / W of the input; all-gather: the input to each of the W - 1
      others (row-wise outputs forward and backward);
    - all-reduce: the tensors reduced (what DDP syncs), counted apart;
    - the hot-row replicas' all-gather of their touched rows (`sharding.hot_reduce`): the input
      to each of the W - 1 others, counted apart (`hot_gather`), not as an all-to-all's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.all_to_all = 0.0
        self.all_reduce = 0.0
        self.hot_gather = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func._schema.name
        if name.startswith("c10d::") or name == "_c10d_functional::all_to_all_single":
            self._count(name, args)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, args: tuple) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if name == "c10d::alltoall_base_":
            source, splits = args[1], list(args[4])
            total = source.numel() * source.element_size()
            rows = source.shape[0] if source.dim() else 0
            own = splits[rank] if splits else rows / world
            kept = own * (total / rows) if rows else 0.0
            self.all_to_all += total - kept
        elif name == "_c10d_functional::all_to_all_single":  # (input, out splits, in splits)
            source, splits = args[0], list(args[2])
            element = source.element_size() * (source.numel() / max(sum(splits), 1))
            self.all_to_all += (sum(splits) - splits[rank]) * element
        elif name == "c10d::_reduce_scatter_base_":
            source = args[1]
            self.all_to_all += source.numel() * source.element_size() * (world - 1) / world
        elif name == "c10d::_allgather_base_":
            from distcache.sharding.hot_reduce import in_hot_gather  # (TorchRec: imported late)

            source = args[1]
            sent = source.numel() * source.element_size() * (world - 1)
            if in_hot_gather():
                self.hot_gather += sent
            else:
                self.all_to_all += sent
        elif name == "c10d::allreduce_":
            self.all_reduce += sum(t.numel() * t.element_size() for t in args[0])
