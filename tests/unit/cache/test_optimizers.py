"""The row optimizers' `zero_gradient_keeps_rows`: where it is claimed, a zero gradient leaves
rows and state bitwise as they were (hot rows update untouched rows with it, unmasked)."""

import pytest
import torch

from distcache.cache.config import CacheConfig
from distcache.cache.optimizers import make_optimizer


@pytest.mark.parametrize(
    ("optimizer", "eps", "keeps"),
    [
        ("sgd", 1e-8, True),
        ("adagrad", 1e-8, True),
        ("rowwise_adagrad", 1e-8, True),
        ("adagrad", 0.0, False),  # 0 / (sqrt(0) + 0) is NaN
        ("adam", 1e-8, False),  # moments decay
    ],
)
def test_a_zero_gradient_keeps_rows_where_claimed(optimizer, eps, keeps):
    opt = make_optimizer(CacheConfig(optimizer=optimizer, eps=eps, learning_rate=0.3))
    assert opt.zero_gradient_keeps_rows is keeps
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 4, generator=gen)
    state = torch.rand(5, opt.state_dim(4), generator=gen)
    state[0] = 0.0  # a row never updated
    new_rows, new_state = rows.clone(), state.clone()
    opt.update(new_rows, new_state, torch.zeros(5, 4))
    same = torch.equal(new_rows, rows) and torch.equal(new_state, state)
    assert same is keeps
