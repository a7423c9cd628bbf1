"""Exact selection of the `want` largest keys, with shapes the host knows and `want` on the device.

The cache needs as many victims as a batch has misses, a count that lives on the device. Sorting
or `topk` by it would need it on the host, so the selection works by counting instead: keys are
small non-negative classes (a policy's eviction order, bounded), a histogram over the classes
gives, for every class, how many keys reach it, and the boundary class and the number of ties
taken from it follow on the device. Every pass is over the keys or the classes: O(C + classes),
no sort, no read-back.
"""

from __future__ import annotations

import torch


def select_largest(
    keys: torch.Tensor, num_classes: int, want: torch.Tensor, size: int, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `want` entries with the largest keys, ties to the lowest indices, in increasing index
    order.

    Args:
        keys: `[m]` int32 or int64 in [-1, num_classes); -1 is never selected.
        num_classes: bound of the keys (a few hundred thousand at most: one histogram bin each).
        want: 0-dim int64, how many to select (on the device).
        size: capacity of the result, known on the host; at least min(want, candidates).
        index: `[m]` int64 `arange(m)` (kept by the caller, to avoid one allocation per call).

    Returns:
        picked: `[size]` int64 the selected indices first, then `m` as padding.
        taken: 0-dim int64, min(want, candidates).
        candidates: 0-dim int64, how many keys are >= 0.

    Example::

        picked, taken, _ = select_largest(keys, 64, misses, size=n, index=torch.arange(m))
    """
    m = keys.numel()
    hist = torch.zeros(num_classes + 1, dtype=keys.dtype, device=keys.device)
    hist.index_add_(0, keys + 1, torch.ones_like(keys))  # bin 0: keys of -1
    at_least = torch.zeros(num_classes + 1, dtype=keys.dtype, device=keys.device)
    below = hist[1:].cumsum(0, dtype=hist.dtype)  # [c] keys <= c (an int cumsum is int64 else)
    at_least[:num_classes] = below[-1] - below + hist[1:]  # [c] keys >= c; [classes] = 0
    # The boundary class: the largest c with at least `want` keys >= c (0 when too few exist).
    boundary = ((at_least[:num_classes] >= want).sum() - 1).clamp(min=0)
    # (Indexing with a 0-dim tensor would read it on the host: index_select keeps it there.)
    need = want - at_least.index_select(0, (boundary + 1).view(1)).squeeze(0)  # boundary ties
    tie = keys == boundary
    # (int32 cumsums: a bool cumsum to int64 is 6x slower on CPU)
    take = (keys > boundary) | (tie & (tie.cumsum(0, dtype=torch.int32) <= need))
    picked = torch.full((size + 1,), m, dtype=torch.int64, device=keys.device)
    rank = (take.cumsum(0, dtype=torch.int32) - 1).clamp_(
        max=size
    )  # past `size` (never when sized): dropped
    picked.scatter_(0, torch.where(take, rank, size), index)
    candidates = at_least[0].long()
    return picked[:size], torch.minimum(want, candidates), candidates


def pack(
    keep: torch.Tensor, rank: torch.Tensor, values: torch.Tensor, size: int, pad: int
) -> torch.Tensor:
    """`[size]`: the `values` whose `keep` is set, each at its `rank` (its index among the kept
    ones), then `pad`. The compaction `values[keep]` with a shape the host knows."""
    out = torch.full((size + 1,), pad, dtype=values.dtype, device=values.device)
    out.scatter_(0, torch.where(keep, rank.clamp(max=size), size), values)
    return out[:size]
