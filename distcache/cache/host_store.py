"""`HostStore`: the authoritative rows of one shard, with their optimizer state, in host memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import weakref

import torch

from distcache.cache.transfer import device_view


class HostStore:
    """Rows `[rows, dim]` and optimizer state `[rows, state_dim]` of a shard in host memory.

    A row and its optimizer state move together (`gather`/`scatter` take both), so the state
    travels with the row between host and cache. They are two tensors rather than one row-major
    `[rows, dim + state_dim]` tensor (DESIGN.md's first sketch) so that each table's weights are
    one contiguous slab: TorchRec exposes a table as a view of such a slab
    (`TableBatchedEmbeddingSlice`) and checkpoints it as a ShardedTensor without copying. It also
    lets the rows be half precision (a table's `data_type`) while the optimizer state stays fp32.
    A row held in the cache is authoritative there; the store's copy is stale until written back.

    Args:
        num_rows: rows of the shard (all tables of the group, concatenated).
        dim: embedding dimension.
        state_dim: optimizer-state columns per row (0 for SGD).
        dtype: the rows' dtype (float32, float16 or bfloat16); the state is float32.
        pin_memory: page-lock the rows, for asynchronous copies to and from a CUDA device and
            for kernels that address them directly (`device_rows`). The memory is allocated as
            usual and registered (`cudaHostRegister`), so it takes what it holds: torch's
            pinned allocator would round 96 GB up to 128 GiB.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        state_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
    ):
        self.num_rows = num_rows
        self.dim = dim
        self.state_dim = state_dim
        # One more row, the *trash* row `num_rows`: direct staging's padding (`transfer`) goes
        # there. The rows proper are a view of the rest.
        self._padded = (
            _host_zeros((num_rows + 1, dim), dtype),
            _host_zeros((num_rows + 1, state_dim), torch.float32),
        )
        self.weights = self._padded[0][:num_rows]  # [rows, dim]
        self.state = self._padded[1][:num_rows]  # [rows, state_dim]
        self.trash_row = num_rows
        if pin_memory:
            for tensor in self._padded:
                _register(tensor)
        self._views: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows_read = 0
        self.rows_written = 0

    @property
    def row_bytes(self) -> int:
        """Bytes of a row as it moves: its weights and its optimizer state."""
        return self.dim * self.weights.element_size() + self.state_dim * self.state.element_size()

    def device_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights `[rows + 1, dim]` and state `[rows + 1, state_dim]`, the trash row last,
        as `device` addresses them (`transfer.device_view`: on CUDA the rows must be pinned)."""
        if device not in self._views:
            self._views[device] = tuple(device_view(t, device) for t in self._padded)
        return self._views[device]

    def gather(
        self, rows: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights `[n, dim]` and state `[n, state_dim]` of host rows `rows` `[n]` (CPU),
        into `out` when given."""
        self.rows_read += rows.numel()
        if out is None:
            return self.weights.index_select(0, rows), self.state.index_select(0, rows)
        torch.index_select(self.weights, 0, rows, out=out[0])
        torch.index_select(self.state, 0, rows, out=out[1])
        return out

    def scatter(self, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Write `weights` `[n, dim]` and `state` `[n, state_dim]` into host rows `rows` `[n]`
        (distinct)."""
        self.rows_written += rows.numel()
        self.weights.index_copy_(0, rows, weights)
        self.state.index_copy_(0, rows, state)


# Transparent huge pages for the rows (Linux): staging reads and writes rows scattered over
# the whole store, and with 4 KiB pages nearly every row costs a TLB miss and a page walk. Huge
# pages make those gathers and write-backs faster and cost time once, when the rows are first
# written (benchmarks/results/README.md, "The engine"). Only an advice: where THP is off or no
# huge page is free, the kernel uses small pages.
_HUGE_PAGE_MIN_BYTES = 32 << 20
_MADV_HUGEPAGE = 14
_PAGE = 4096


def _host_zeros(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor; if it is large, its pages advised huge before they are touched."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= _HUGE_PAGE_MIN_BYTES:
        _advise_huge_pages(tensor.data_ptr(), nbytes)
    return tensor.zero_()


def _advise_huge_pages(address: int, nbytes: int) -> bool:
    """`madvise(MADV_HUGEPAGE)` over the whole pages of [address, address + nbytes); whether
    the kernel took the advice (False off Linux, or where THP is not built in)."""
    libc = _libc()
    if libc is None:
        return False
    start = -(-address // _PAGE) * _PAGE
    length = (address + nbytes - start) // _PAGE * _PAGE
    return length > 0 and libc.madvise(start, length, _MADV_HUGEPAGE) == 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with `madvise` declared (loaded once), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def _register(tensor: torch.Tensor) -> None:
    """Page-lock `tensor`'s memory for the CUDA driver, until the tensor is collected."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    cudart = torch.cuda.cudart()
    # Portable (1) | mapped (2): every device may address it (`transfer.device_view`).
    torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 3))
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
