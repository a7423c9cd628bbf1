"""Exact selection of the `want` largest keys, with shapes the host knows and `want` on the device.

The cache needs as many victims as a batch has misses, a count that lives on the device. Sorting
or `topk` by it would need it on the host, so the selection works by counting instead: keys are
small non-negative classes (a policy's eviction order, bounded), a histogram over the classes
gives, for every class, how many keys reach it, and the boundary class (a binary search of the
histogram's running sum) and the number of ties taken from it follow on the device; the selected
indices are compacted by `nonzero_static`, whose output size the host gives (on CUDA it does not
synchronize, since PyTorch 2.6). Every pass is over the keys or the classes: O(C + classes), no
sort, no read-back.
"""

from __future__ import annotations

import torch


def select_largest(
    keys: torch.Tensor, num_classes: int, want: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `want` entries with the largest keys, ties to the lowest indices, in increasing index
    order.

    Args:
        keys: `[m]` int32 or int64 in [-1, num_classes); -1 is never selected.
        num_classes: bound of the keys (a few hundred thousand at most: one histogram bin each).
        want: 0-dim int64, how many to select (on the device).
        size: capacity of the result, known on the host; at least min(want, candidates).

    Returns:
        picked: `[size]` int64 the selected indices first, then `m` as padding.
        taken: 0-dim int64, min(want, candidates).
        candidates: 0-dim int64, how many keys are >= 0.

    Example::

        picked, taken, _ = select_largest(keys, 64, misses, size=n)
    """
    m = keys.numel()
    hist = torch.zeros(num_classes + 1, dtype=keys.dtype, device=keys.device)
    hist.index_add_(0, keys + 1, keys.new_ones(1).expand(m))  # bin 0: keys of -1
    return select_counted(keys, hist, num_classes, want, size)


def select_counted(
    keys: torch.Tensor, hist: torch.Tensor, num_classes: int, want: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select_largest` of `keys` whose histogram is counted already: `hist` `[num_classes +
    1]`, bin k + 1 the keys of class k (bin 0 those of -1)."""
    m = keys.numel()
    below = hist[1:].cumsum(0, dtype=hist.dtype)  # [c] keys in [0, c] (an int cumsum is int64 else)
    candidates = below[-1:].long()  # [1] keys >= 0
    # The boundary class: the largest c with at least `want` keys >= c, that is with at most
    # `candidates - want` keys below c: the keys below c are below[c - 1], which grows with c
    # (0 when too few keys exist: then every candidate is taken).
    spare = (candidates - want).to(below.dtype)
    boundary = torch.searchsorted(below, spare, right=True).clamp_(max=num_classes - 1)  # [1]
    need = want - (candidates - below.index_select(0, boundary))  # [1] ties to take
    # Ties are taken in index order: the first `need` keys equal to the boundary.
    boundary = boundary.to(keys.dtype)  # (comparisons of mixed dtypes convert every key)
    tie = keys == boundary
    take = (keys > boundary) | (tie & (tie.cumsum(0, dtype=torch.int32) <= need.to(torch.int32)))
    picked = torch.nonzero_static(take, size=size, fill_value=m).squeeze(1)
    candidates = candidates.squeeze(0)
    return picked, torch.minimum(want, candidates), candidates


def pack(
    keep: torch.Tensor, rank: torch.Tensor, values: torch.Tensor, size: int, pad: int
) -> torch.Tensor:
    """`[size]`: the `values` whose `keep` is set, each at its `rank` (its index among the kept
    ones), then `pad`. The compaction `values[keep]` with a shape the host knows; every kept
    rank must be below `size` (the callers' ranks are a running count of what they keep)."""
    out = torch.full((size + 1,), pad, dtype=values.dtype, device=values.device)
    out.scatter_(0, torch.where(keep, rank, size), values)
    return out[:size]
