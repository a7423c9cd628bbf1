"""The host store: rows and optimizer state in host memory, huge pages for large ones."""

import sys
from pathlib import Path

import pytest
import torch

from distcache.cache.host_store import _HUGE_PAGE_MIN_BYTES, HostStore

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise, never), or '' if none."""
    if not sys.platform.startswith("linux") or not _THP.exists():
        return ""
    text = _THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _mapping_fields(address: int) -> dict[str, str]:
    """`/proc/self/smaps`'s fields of the mapping that holds `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside:
                fields[head.rstrip(":")] = line.split()[1]
    return fields


@pytest.mark.skipif(
    _thp_mode() != "madvise",
    reason="needs Linux with transparent huge pages in madvise mode (in 'always' every mapping "
    "is eligible, in 'never' none)",
)
def test_large_stores_ask_for_huge_pages():
    rows = _HUGE_PAGE_MIN_BYTES // (16 * 4) + 1000
    store = HostStore(rows, 16, 2)
    middle = store.weights.data_ptr() + rows * 16 * 2  # inside the advised whole pages
    fields = _mapping_fields(middle)
    if "THPeligible" not in fields:
        pytest.skip("this kernel's /proc/self/smaps has no THPeligible field")
    assert fields["THPeligible"] == "1"
    small = HostStore(1000, 16, 0)  # below the bound: left to the allocator
    assert not bool(small.weights.any()) and not bool(store.state.any())


def test_rows_start_at_zero_and_move_with_their_state():
    rows = _HUGE_PAGE_MIN_BYTES // (8 * 4) + 10
    store = HostStore(rows, 8, 1)
    assert not bool(store.weights.any()) and not bool(store.state.any())
    picked = torch.tensor([3, rows - 1, 0])
    weights = torch.arange(24, dtype=torch.float32).view(3, 8)
    store.scatter(picked, weights, torch.tensor([[1.0], [2.0], [3.0]]))
    got_w, got_s = store.gather(torch.tensor([0, rows - 1]))
    assert torch.equal(got_w, weights[[2, 1]]) and got_s.flatten().tolist() == [3.0, 2.0]
