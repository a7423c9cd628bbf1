"""`HostStore`: the authoritative rows of one shard, with their optimizer state, in host memory."""

from __future__ import annotations

import weakref

import torch


class HostStore:
    """Rows `[rows, dim]` and optimizer state `[rows, state_dim]` of a shard in host memory.

    A row and its optimizer state move together (`gather`/`scatter` take both), so the state
    travels with the row between host and cache. They are two tensors rather than one row-major
    `[rows, dim + state_dim]` tensor (DESIGN.md's first sketch) so that each table's weights are
    one contiguous slab: TorchRec exposes a table as a view of such a slab
    (`TableBatchedEmbeddingSlice`) and checkpoints it as a ShardedTensor without copying.
    A row held in the cache is authoritative there; the store's copy is stale until written back.

    Args:
        num_rows: rows of the shard (all tables of the group, concatenated).
        dim: embedding dimension.
        state_dim: optimizer-state columns per row (0 for SGD).
        pin_memory: page-lock the rows, for asynchronous copies to and from a CUDA device. The
            memory is allocated as usual and registered (`cudaHostRegister`), so it takes what
            it holds: torch's pinned allocator would round 96 GB up to 128 GiB.
    """

    def __init__(self, num_rows: int, dim: int, state_dim: int, *, pin_memory: bool = False):
        self.num_rows = num_rows
        self.dim = dim
        self.state_dim = state_dim
        self.weights = torch.zeros(num_rows, dim)  # [rows, dim]
        self.state = torch.zeros(num_rows, state_dim)  # [rows, state_dim]
        if pin_memory:
            for tensor in (self.weights, self.state):
                _register(tensor)
        self.rows_read = 0
        self.rows_written = 0

    @property
    def width(self) -> int:
        """Columns of a row as it moves: weights then optimizer state."""
        return self.dim + self.state_dim

    @property
    def row_bytes(self) -> int:
        return self.width * self.weights.element_size()

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `[n, dim + state_dim]` (weights, then state) for host rows `rows` `[n]` (CPU)."""
        self.rows_read += rows.numel()
        parts = [self.weights.index_select(0, rows), self.state.index_select(0, rows)]
        return torch.cat(parts, dim=1) if out is None else torch.cat(parts, dim=1, out=out)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` `[n, dim + state_dim]` into host rows `rows` `[n]` (distinct)."""
        self.rows_written += rows.numel()
        self.weights.index_copy_(0, rows, values[:, : self.dim])
        self.state.index_copy_(0, rows, values[:, self.dim :])


def _register(tensor: torch.Tensor) -> None:
    """Page-lock `tensor`'s memory for the CUDA driver, until the tensor is collected."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0))
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
