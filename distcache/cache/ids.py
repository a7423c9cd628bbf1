"""Id validation without a device read-back: every id must lie in [0, rows) of its feature's table.

`find_invalid` (from each id's feature) or `find_invalid_per_feature` (from each feature's id
count, for feature-major ids) runs on the device with the batch: it returns which ids are
invalid (the caller redirects them to the sentinel row, so they read zeros and nothing is loaded
or updated for them) and a record of the first one. The record reaches the host with the
batch's plan, and `raise_if_invalid` raises before the batch is looked up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distcache.errors import InvalidIdError

RECORD_SIZE = 4  # invalid count, position of the first invalid id, its value, its feature


def find_invalid(
    values: torch.Tensor, feature_of_id: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Invalid ids of a batch, on the device.

    Args:
        values: ids `[n]` int64.
        feature_of_id: the feature of each id `[n]` int64.
        rows: table rows of each feature `[features]`.

    Returns:
        bad: `[n]` bool, the ids outside [0, rows of their feature).
        record: `[4]` int64: how many, the position of the first, its value and its feature.
    """
    bad = (values < 0) | (values >= rows.index_select(0, feature_of_id))
    if values.numel() == 0:
        return bad, _empty_record(values.device)
    first = _first(bad)
    return bad, _record(bad, values, first, feature_of_id.index_select(0, first))


def find_invalid_per_feature(
    values: torch.Tensor, ids_per_feature: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`find_invalid` for ids in feature-major order, from each feature's id count: each id's
    bound comes from one `repeat_interleave` of the features' rows, and the first invalid id's
    feature from its position among the features' ends, so no per-id feature is built.

    Args:
        values: ids `[n]`, all of feature 0, then all of feature 1, ...
        ids_per_feature: how many ids each feature holds `[features]` int64, summing to n.
        rows: table rows of each feature `[features]` int64.

    Returns:
        As `find_invalid`.
    """
    n = values.numel()
    bound = rows.repeat_interleave(ids_per_feature, output_size=n)  # [n]
    bad = (values < 0) | (values >= bound)
    if n == 0:
        return bad, _empty_record(values.device)
    first = _first(bad)
    # The first feature whose ids end past `first` (an empty feature ends where it starts).
    feature = torch.searchsorted(ids_per_feature.cumsum(0), first, right=True)
    return bad, _record(bad, values, first, feature)


def _empty_record(device: torch.device) -> torch.Tensor:
    return torch.zeros(RECORD_SIZE, dtype=torch.int64, device=device)


def _first(bad: torch.Tensor) -> torch.Tensor:
    """`[1]` the position of the first true entry of `bad` (0 if none): argmax returns the
    first of equal maxima; the bools are read as bytes in place."""
    return bad.view(torch.uint8).argmax().view(1)


def _record(
    bad: torch.Tensor, values: torch.Tensor, first: torch.Tensor, feature: torch.Tensor
) -> torch.Tensor:
    """`[4]` int64: the invalid count, the first's position, its value and its feature."""
    return torch.cat([bad.sum().view(1), first, values.index_select(0, first), feature])


def raise_if_invalid(
    record: list[int], rows_of: Callable[[int], int], describe: Callable[[int], str]
) -> None:
    """Raise `InvalidIdError` if the host copy of a `find_invalid` record counts invalid ids.

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
