"""The row optimizers' `zero_gradient_keeps_rows`: where it is claimed, a zero gradient leaves
rows and state bitwise as they were (hot rows update untouched rows with it, unmasked)."""

import pytest
import torch

from distcache.cache.config import CacheConfig
from distcache.cache.optimizers import make_optimizer, round_stochastically


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased(dtype):
    torch.manual_seed(0)
    gap = 2.0**-10 if dtype == torch.float16 else 2.0**-7  # between 1 and the next value up
    x = torch.tensor([1.0 + gap / 4, -(1.0 + 3 * gap / 4), 1.0 + gap / 2]).repeat(20_000, 1)
    rounded = round_stochastically(x, dtype)
    assert rounded.dtype == dtype
    for column, (low, high) in enumerate([(1.0, 1 + gap), (-1 - gap, -1.0), (1.0, 1 + gap)]):
        values = rounded[:, column].float()
        assert set(values.unique().tolist()) == {low, high}
        assert abs(values.mean().item() - x[0, column].item()) < gap / 50  # (~8 sigma)
    exact = torch.tensor([1.0, -2.5, 0.0, -0.0, float("inf"), float("-inf")])
    assert torch.equal(round_stochastically(exact, dtype), exact.to(dtype))
    assert round_stochastically(torch.tensor([float("nan")]), dtype).isnan().all()
