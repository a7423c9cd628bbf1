"""Exact selection of the n largest keys, faster than `torch.topk` for large n on CPU."""

from __future__ import annotations

import torch

_SAMPLE = 4096
_SMALL = 1 << 13


def largest(keys: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices `[n]` of the `n` largest entries of `keys` `[m]`, largest first.

    Ties are broken by lower index, so the result does not depend on the random sample, which
    only estimates a threshold that keeps the candidates few: the candidates (keys at or above
    the threshold) are sorted, not all of `keys`. CPU `topk` costs O(m log n) and is slow for the
    tens of thousands of victims a large batch needs; this is a few linear passes plus a sort of
    about 1.25 n keys.

    Args:
        keys: int64 scores, higher is selected first.
        n: how many to select, 0 <= n <= keys.numel().
        generator: random source for the sample (its own, so it does not disturb user RNG).
    """
    m = keys.numel()
    if n <= 0:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    if m <= _SMALL or 4 * n >= m:
        return torch.argsort(keys, descending=True, stable=True)[:n]
    pick = torch.randint(m, (_SAMPLE,), device=keys.device, generator=generator)
    sample = torch.sort(keys[pick], descending=True).values
    # Sample rank expected to sit just above the n-th largest key, with a safety margin.
    rank = min(_SAMPLE - 1, int(_SAMPLE * n / m * 1.25) + 16)
    candidates = (keys >= sample[rank]).nonzero().squeeze(1)
    if candidates.numel() < n:  # unlucky sample: fall back to the full sort
        return torch.argsort(keys, descending=True, stable=True)[:n]
    order = torch.argsort(keys[candidates], descending=True, stable=True)[:n]
    return candidates[order]
