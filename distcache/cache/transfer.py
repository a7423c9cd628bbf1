"""Row copies between the host store and the cache whose count only the device knows.

The *direct* staging design (`CacheConfig.staging="direct"`): the staging stream copies a plan's
dirty victims into the host store and its misses into the cache itself, reading and writing the
page-locked host rows through their device address (unified addressing), so no thread waits for
the plan's counts and no host buffer is filled. A plan's transfers are packed at the front of
buffers of `size` entries and counted on the device (`StagePlan.counts`), so a copy is bounded by
a count the host never reads:

- on CUDA with Triton, a few programs (`STAGING_PROGRAMS`, so that staging takes few of the
  GPU's thread blocks from training) read the count and stride over the entries below it, a
  few rows at a time: the padding moves no byte over the host link;
- elsewhere (on CPU, which CI tests, or without Triton) the same copy is `index_select` and
  `index_copy_` over all `size` entries, the padding redirected to a *trash* row of the
  destination (and read from a trash row of the source), which nothing else reads.

`device_view(tensor, device)` is the device's address of a host tensor: on CUDA a tensor over the
page-locked memory (`cudaHostRegister`, `HostStore(pin_memory=True)`), built with
`__cuda_array_interface__`; on CPU the tensor itself.
"""

from __future__ import annotations

import functools

import torch

from distcache.errors import DistcacheConfigError

# The rows' dtypes; a view wraps them as integers of their size and retypes them (the array
# interface has no code for bfloat16).
_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: At most this many Triton programs (thread blocks) copy a plan's rows, whatever its size.
STAGING_PROGRAMS = 16
_TILE = 4096  # elements a program copies per step: `ROWS` rows of a power-of-two width


def device_view(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (a contiguous host tensor) as the device addresses it: itself on CPU; on CUDA a
    tensor over the same memory, which must be page-locked (`cudaHostRegister`)."""
    if device.type != "cuda":
        return tensor
    if tensor.numel() == 0:  # (no memory to address: the optimizer state of SGD)
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    if not tensor.is_contiguous() or tensor.dtype not in _ROW_DTYPES:
        raise DistcacheConfigError(
            f"a device view needs a contiguous host tensor of {sorted(map(str, _ROW_DTYPES))}, "
            f"got {tensor.dtype}, contiguous={tensor.is_contiguous()}"
        )

    class _Interface:  # what torch.as_tensor reads to wrap a device pointer
        __cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": f"<i{tensor.element_size()}",
            "data": (tensor.data_ptr(), False),
            "strides": None,  # C-contiguous
            "version": 3,
        }

    with torch.cuda.device(device):
        view = torch.as_tensor(_Interface(), device=device)
    if view.data_ptr() != tensor.data_ptr():  # torch copied it: the driver put it elsewhere
        raise DistcacheConfigError(
            f"the page-locked host rows are not addressable from {device} (torch made a copy); "
            "register them while that device is current, or use staging='worker'"
        )
    view = view.view(tensor.dtype)
    view._distcache_host = tensor  # the host tensor outlives its view
    return view


def copy_rows(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    count: torch.Tensor,
    *,
    src_trash: int,
    dst_trash: int,
) -> None:
    """`dst[dst_rows[i]] = src[src_rows[i]]` for every `i < count` (a 1-element int64 tensor on
    the device, never read by the host), on the current stream.

    `src_rows` and `dst_rows` are `[size]` int64; the real entries' destination rows are
    distinct. Entries from `count` on may be copied from row `src_trash` to row `dst_trash`
    instead (the torch path does): those rows must be ones nothing else reads.
    """
    if src_rows.numel() == 0:
        return
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise DistcacheConfigError(
            f"copy_rows: rows of {src.dtype} {tuple(src.shape[1:])} cannot go to rows of "
            f"{dst.dtype} {tuple(dst.shape[1:])}"
        )
    if src.shape[1] == 0:
        return
    kernel = _triton_kernel(interpret=False) if dst.is_cuda else None
    if kernel is not None:
        triton_copy_rows(kernel, src, src_rows, dst, dst_rows, count)
        return
    live = torch.arange(src_rows.numel(), device=src_rows.device) < count
    picked = src.index_select(0, torch.where(live, src_rows, src_trash))
    dst.index_copy_(0, torch.where(live, dst_rows, dst_trash), picked)


def triton_copy_rows(
    kernel,  # a triton.JITFunction
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    count: torch.Tensor,
    *,
    programs: int | None = None,
) -> None:
    """`copy_rows` by a Triton kernel: entries from `count` on copy nothing. `programs`: at
    most this many thread blocks (default `STAGING_PROGRAMS`), each copying `ROWS` rows a step
    until the count."""
    width = src.shape[1]
    block = max(16, 1 << (width - 1).bit_length())
    rows = max(1, min(32, _TILE // block))
    grid = max(1, min(programs or STAGING_PROGRAMS, -(-src_rows.numel() // rows)))
    kernel[(grid,)](
        src, src_rows, dst, dst_rows, count, width, src.stride(0), dst.stride(0),
        BLOCK=block, ROWS=rows,
    )  # fmt: skip


@functools.cache
def _triton_kernel(*, interpret: bool):
    """The Triton kernel of `copy_rows` (`transfer_kernel`), or None without Triton.
    `interpret`: run by Triton's interpreter, on CPU tensors (for tests)."""
    try:
        from distcache.cache import transfer_kernel
    except ImportError:
        return None
    return transfer_kernel.build(interpret=interpret)
