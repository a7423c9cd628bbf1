"""Hot rows send each table's float64 learning rate in their float32 all-reduce as three parts
(`distcache.sharding.hot_rows._lr_parts`): exact, or refused."""

import numpy as np
import pytest

from distcache.errors import UnsupportedError
from distcache.sharding.hot_rows import _lr_parts


def test_a_learning_rate_survives_its_float32_parts_exactly():
    rng = np.random.default_rng(0)
    rates = [0.1, 1 / 3, 0.0, 0.05 * 0.97**57, 123.456, 1e-20, *rng.uniform(1e-6, 10, 10_000)]
    for lr in map(float, rates):
        parts = _lr_parts(lr)
        assert all(float(np.float32(p)) == p for p in parts)  # each a float32
        assert parts[0] + parts[1] + parts[2] == lr  # their float64 sum, as finish_step adds
        # What the other ranks add: zeros, which change no part.
        assert [float(np.float32(p) + np.float32(0.0)) for p in parts] == list(parts)
    assert float(np.float32(0.1)) != 0.1  # one float32 would not do


def test_a_rate_too_small_for_the_parts_is_refused():
    with pytest.raises(UnsupportedError, match="cannot be sent exactly"):
        _lr_parts(1e-300)
