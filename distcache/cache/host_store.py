"""`HostStore`: the authoritative rows of one shard, with their optimizer state, in host memory."""

from __future__ import annotations

import torch


class HostStore:
    """Rows and optimizer state of a shard in one row-major host tensor `[rows, dim + state_dim]`.

    Keeping a row's optimizer state next to its weights means one gather moves both, so a row's
    state travels with it between host and cache (FBGEMM's SSD TBE stores rows the same way).
    A row held in the cache is authoritative there; the store's copy is stale until written back.

    Args:
        num_rows: rows of the shard (all tables of the group, concatenated).
        dim: embedding dimension.
        state_dim: optimizer-state columns per row (0 for SGD).
        pin_memory: allocate page-locked memory, for asynchronous host-to-device copies on CUDA.
    """

    def __init__(self, num_rows: int, dim: int, state_dim: int, *, pin_memory: bool = False):
        self.num_rows = num_rows
        self.dim = dim
        self.state_dim = state_dim
        self.data = torch.zeros(num_rows, dim + state_dim, pin_memory=pin_memory)
        self.rows_read = 0
        self.rows_written = 0

    @property
    def weights(self) -> torch.Tensor:
        """`[rows, dim]` view of the weights (stale for dirty rows held in the cache)."""
        return self.data[:, : self.dim]

    @property
    def state(self) -> torch.Tensor:
        """`[rows, state_dim]` view of the optimizer state."""
        return self.data[:, self.dim :]

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `[n, dim + state_dim]` for host row indices `rows` `[n]` (int64, on CPU)."""
        self.rows_read += rows.numel()
        if out is None:
            return self.data.index_select(0, rows)
        return torch.index_select(self.data, 0, rows, out=out)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` `[n, dim + state_dim]` into host rows `rows` `[n]` (distinct)."""
        self.rows_written += rows.numel()
        self.data.index_copy_(0, rows, values)
