"""Row-wise fused optimizers, applied to cache rows in backward.

Each optimizer updates the rows a batch used, in place in the cache, with the batch's gradient
summed per row (as a coalesced sparse gradient would be). Its per-row state lives in the
cache's state columns and travels with the row to and from the host store. Rows not in the
batch are untouched (the "lazy" semantics of sparse optimizers and of FBGEMM's fused kernels).
"""

from __future__ import annotations

import abc
import math

import torch

from distcache.cache.config import CacheConfig


class RowOptimizer(abc.ABC):
    """A fused optimizer over embedding rows."""

    #: The update is linear in the gradient and stateless, so it may be applied id by id
    #: (a scatter-add into the cache) without summing the gradient per row first.
    per_id: bool = False

    def __init__(self, config: CacheConfig):
        self.lr = config.learning_rate
        self.eps = config.eps

    @property
    def zero_gradient_keeps_rows(self) -> bool:
        """A row (and its state) updated with a zero gradient stays exactly as it was, so a
        dense update of rows some of which are untouched needs no mask."""
        return False

    @abc.abstractmethod
    def state_dim(self, dim: int) -> int:
        """Optimizer-state columns per row of width `dim`."""

    @abc.abstractmethod
    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        """Update rows in place.

        `weights` `[u, dim]`, `state` `[u, state_dim]`, `grad` `[u, dim]` (summed per row).
        """

    def step(self) -> None:
        """One optimizer step has been applied to every group (Adam's bias correction)."""

    def state_dict(self) -> dict[str, float | int]:
        return {}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        del state


class SGD(RowOptimizer):
    """w -= lr * g"""

    per_id = True

    @property
    def zero_gradient_keeps_rows(self) -> bool:
        return True  # w - lr * 0 == w

    def state_dim(self, dim: int) -> int:
        return 0

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        weights.add_(grad, alpha=-self.lr)


class Adagrad(RowOptimizer):
    """Element-wise Adagrad (torch.optim.Adagrad with sparse gradients, no decay):
    s += g^2; w -= lr * g / (sqrt(s) + eps)."""

    @property
    def zero_gradient_keeps_rows(self) -> bool:
        return self.eps > 0  # s + 0 == s; w - lr * 0 / (sqrt(s) + eps) == w unless 0 / 0

    def state_dim(self, dim: int) -> int:
        return dim

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        state.addcmul_(grad, grad)
        weights.addcdiv_(grad, state.sqrt().add_(self.eps), value=-self.lr)


class RowWiseAdagrad(RowOptimizer):
    """Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): one accumulator per row,
    s += mean(g^2); w -= lr * g / (sqrt(s) + eps)."""

    @property
    def zero_gradient_keeps_rows(self) -> bool:
        return self.eps > 0  # as Adagrad

    def state_dim(self, dim: int) -> int:
        return 1

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        state.add_(grad.square().mean(dim=1, keepdim=True))
        weights.addcdiv_(grad, state.sqrt().add_(self.eps), value=-self.lr)


class Adam(RowOptimizer):
    """Lazy Adam (torch.optim.SparseAdam): moments of the used rows only, bias correction with
    the global step count. State per row: [exp_avg (dim), exp_avg_sq (dim)]."""

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        self.beta1 = config.beta1
        self.beta2 = config.beta2
        self.steps = 0

    def state_dim(self, dim: int) -> int:
        return 2 * dim

    def update(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        dim = grad.shape[1]
        exp_avg, exp_avg_sq = state[:, :dim], state[:, dim:]
        step = self.steps + 1
        exp_avg.lerp_(grad, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias1 = 1 - self.beta1**step
        bias2 = 1 - self.beta2**step
        denom = exp_avg_sq.sqrt().add_(self.eps)
        weights.addcdiv_(exp_avg, denom, value=-self.lr * math.sqrt(bias2) / bias1)

    def step(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, float | int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.steps = int(state["steps"])


def make_optimizer(config: CacheConfig) -> RowOptimizer:
    """The row optimizer named by `config.optimizer`."""
    kinds = {"sgd": SGD, "adagrad": Adagrad, "rowwise_adagrad": RowWiseAdagrad, "adam": Adam}
    return kinds[config.optimizer](config)


# Low bits of an fp32 value below the last mantissa bit each half dtype keeps.
_DROPPED_BITS = {torch.float16: 13, torch.bfloat16: 16}


def round_stochastically(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `x` in `dtype` (float16 or bfloat16), each value rounded to one of its two
    neighbours in `dtype`, up with the probability of its remainder over the gap between them
    (unbiased): a uniform random integer is added to the bits the dtype drops, which are then
    cleared (a carry into the kept bits rounds up). The magnitude is rounded, so negative
    values alike. Exact for bfloat16 and for float16's normal range; below it (|x| < 2**-14,
    float16's subnormals) the kept value is then rounded to nearest. Infinities and NaN pass
    unchanged. Draws from torch's default generator on `x`'s device (no synchronization)."""
    dropped = _DROPPED_BITS[dtype]
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << dropped, x.shape, dtype=torch.int32, device=x.device)
    kept = (bits + noise).bitwise_and_(~((1 << dropped) - 1))
    rounded = kept.view(torch.float32).to(dtype)
    return torch.where(torch.isfinite(x), rounded, x.to(dtype))
