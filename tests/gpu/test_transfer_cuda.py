"""Direct staging's pieces on CUDA: the device view of pinned host rows, and `copy_rows` (its
Triton kernel where Triton is installed) between them and device memory, against the CPU path."""

from __future__ import annotations

import pytest
import torch

from distcache.cache.host_store import HostStore
from distcache.cache.transfer import _triton_kernel, copy_rows
from tests.gpu.common import CUDA_REASON

DEVICE = torch.device("cuda")
PIN = DEVICE.type == "cuda"  # (a copy of this module with DEVICE = cpu checks its logic)
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_device_view_is_the_pinned_host_rows(dtype):
    store = HostStore(50, 24, 2, dtype=dtype, pin_memory=PIN)
    store.weights.copy_(torch.randn(50, 24).to(dtype))
    weights, state = store.device_rows(DEVICE)
    assert weights.device.type == DEVICE.type and weights.shape == (51, 24)
    assert state.shape == (51, 2)
    assert torch.equal(weights[:50].cpu(), store.weights)  # the device reads the host's rows
    weights[7].fill_(3)  # and writes them
    if PIN:
        torch.cuda.synchronize()
    assert torch.equal(store.weights[7], torch.full((24,), 3, dtype=dtype))


@pytest.mark.parametrize("width", [1, 64, 128, 200])
def test_copy_rows_between_pinned_host_rows_and_the_device_matches_the_cpu(width):
    gen = torch.Generator().manual_seed(width)
    store = HostStore(1000, width, 0, pin_memory=PIN)
    store.weights.copy_(torch.randn(1000, width, generator=gen))
    cache = torch.randn(301, width, generator=gen)
    rows = torch.randperm(1000, generator=gen)[:256]
    slots = torch.randperm(300, generator=gen)[:256]
    count = torch.tensor([97])
    expected = cache.clone()
    copy_rows(store.weights, rows, expected, slots, count, src_trash=999, dst_trash=300)
    on_device = cache.to(DEVICE)
    host, _ = store.device_rows(DEVICE)
    copy_rows(host, rows.to(DEVICE), on_device, slots.to(DEVICE), count.to(DEVICE),
              src_trash=store.trash_row, dst_trash=300)  # fmt: skip
    assert torch.equal(on_device[:300].cpu(), expected[:300])
    if PIN and _triton_kernel(interpret=False) is not None:  # the kernel skipped the padding
        assert torch.equal(on_device[300].cpu(), cache[300])
