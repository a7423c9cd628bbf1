"""Id validation: every id must lie in [0, rows) of the table its feature looks up."""

from __future__ import annotations

from collections.abc import Callable

import torch

from distcache.errors import InvalidIdError


def check_ids(
    values: torch.Tensor,
    feature_of_id: torch.Tensor,
    rows: torch.Tensor,
    describe: Callable[[int], str],
) -> None:
    """Raise `InvalidIdError` if an id is negative or not below its feature's table size.

    Args:
        values: ids `[n]`.
        feature_of_id: the feature of each id `[n]`.
        rows: table rows of each feature `[features]`.
        describe: names feature f for the message, e.g. "table 't1' (feature 'f1')".
    """
    bad = (values < 0) | (values >= rows[feature_of_id])
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        feature = int(feature_of_id[i])
        raise InvalidIdError(
            f"{describe(feature)}: id {int(values[i])} at position {i} is out of range: ids "
            f"must be in [0, {int(rows[feature])}) ({int(bad.sum())} invalid id(s) in this "
            "batch; nothing was enqueued or updated)"
        )
