"""Id validation without a device read-back: every id must lie in [0, rows) of its feature's table.

`find_invalid` (from each id's bound) or `find_invalid_per_feature` (from each feature's id
count, for feature-major ids) runs on the device with the batch: it returns which ids are
invalid (the caller redirects them to the sentinel row, so they read zeros and nothing is loaded
or updated for them) and how many. The count reaches the host with the batch's plan; where it
is not 0, `first_invalid` finds the first invalid id on the host (the batch's ids were kept
with it) and `raise_if_invalid` raises before the batch is looked up. So a valid batch costs
the check, the count and nothing more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distcache.errors import InvalidIdError


def find_invalid(values: torch.Tensor, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Invalid ids of a batch, on the device.

    Args:
        values: ids `[n]` int64.
        bound: the rows of each id's table `[n]`.

    Returns:
        bad: `[n]` bool, the ids outside [0, bound).
        count: `[1]` int64, how many (for the host: `first_invalid` names the first).
    """
    bad = (values < 0) | (values >= bound)
    return bad, bad.sum().view(1)


def find_invalid_per_feature(
    values: torch.Tensor, ids_per_feature: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`find_invalid` for ids in feature-major order, from each feature's id count: each id's
    bound is one `repeat_interleave` of the features' rows.

    Args:
        values: ids `[n]`, all of feature 0, then all of feature 1, ...
        ids_per_feature: how many ids each feature holds `[features]` int64, summing to n.
        rows: table rows of each feature `[features]` int64.

    Returns:
        As `find_invalid`.
    """
    return find_invalid(values, rows.repeat_interleave(ids_per_feature, output_size=values.numel()))


def first_invalid(
    values: torch.Tensor,
    ids_per_feature: torch.Tensor,
    rows: torch.Tensor,
    count: int | None = None,
) -> list[int]:
    """The record `raise_if_invalid` words its error from, for a batch whose count (from
    `find_invalid*`) was not 0: how many ids are invalid, the position of the first, its value
    and its feature (arguments as `find_invalid_per_feature`'s). It reads them on the host: the
    error path only, where the batch is not trained anyway. `count`: the device's count, which
    the record keeps (so the error is raised even if the caller has since changed its ids)."""
    values, ids_per_feature, rows = (t.cpu().long() for t in (values, ids_per_feature, rows))
    bad, _ = find_invalid_per_feature(values, ids_per_feature, rows)
    first = int(bad.view(torch.uint8).argmax()) if bad.numel() else 0  # the first of equal maxima
    # The first feature whose ids end past `first` (an empty feature ends where it starts).
    ends = ids_per_feature.cumsum(0)
    feature = int(torch.searchsorted(ends, torch.tensor(first), right=True))
    value = int(values[first]) if bad.numel() else 0
    return [int(bad.sum()) if count is None else count, first, value, feature]


def raise_if_invalid(
    record: list[int], rows_of: Callable[[int], int], describe: Callable[[int], str]
) -> None:
    """Raise `InvalidIdError` if a `first_invalid` record counts invalid ids.

    Args:
        record: the record, on the host.
        rows_of: the table rows of feature f.
        describe: names feature f for the message, e.g. "table 't1' (feature 'f1')".
    """
    count, position, value, feature = record
    if count:
        raise InvalidIdError(
            f"{describe(feature)}: id {value} at position {position} is out of range: ids must "
            f"be in [0, {rows_of(feature)}) ({count} invalid id(s) in this batch; the batch was "
            "not trained and nothing was updated)"
        )
