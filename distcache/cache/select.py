"""Exact selection of the n largest keys, faster than `torch.topk` or a sort for large n on CPU."""

from __future__ import annotations

import torch

_SAMPLE = 4096
_SMALL = 1 << 13


def largest(keys: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices `[n]` of the `n` largest entries of `keys` `[m]`, in increasing index order.

    Among equal keys at the boundary the lower indices are taken, so the result does not depend
    on the random sample, which only estimates a threshold that keeps the candidates few (keys at
    or above it, about 1.25 n of them). The n-th largest candidate is then found with a selection
    (`kthvalue`), not a sort. CPU `topk` costs O(m log n) and is slow for the tens of thousands
    of victims a large batch needs; this is a few linear passes.

    Args:
        keys: int64 scores, higher is selected first.
        n: how many to select, 0 <= n <= keys.numel().
        generator: random source for the sample (its own, so it does not disturb user RNG).
    """
    m = keys.numel()
    if n <= 0:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    if n >= m:
        return torch.arange(m, device=keys.device)
    candidates = None
    if m > _SMALL and 4 * n < m:
        pick = torch.randint(m, (_SAMPLE,), device=keys.device, generator=generator)
        sample = torch.sort(keys[pick], descending=True).values
        # Sample rank expected to sit just above the n-th largest key, with a safety margin.
        rank = min(_SAMPLE - 1, int(_SAMPLE * n / m * 1.25) + 16)
        candidates = (keys >= sample[rank]).nonzero().squeeze(1)  # [c] increasing
        if candidates.numel() < n:  # unlucky sample: select among all keys
            candidates = None
    values = keys if candidates is None else keys[candidates]
    # The n-th largest value, then everything above it and the first ties equal to it.
    threshold = torch.kthvalue(values, values.numel() - n + 1).values
    above = values > threshold
    ties = (values == threshold).nonzero().squeeze(1)[: n - int(above.sum())]
    chosen = above
    chosen[ties] = True
    picked = chosen.nonzero().squeeze(1)
    return picked if candidates is None else candidates[picked]
