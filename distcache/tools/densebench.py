"""The timed kernels of `python -m distcache calibrate` for the dense part of a step:

- `measure_dense_flops`, `measure_dense_layer_overhead`, `measure_activation_bandwidth`: an
  MLP's achieved FLOP/s, the dispatch cost of a layer, its activation traffic;
- `measure_interaction_costs`: DLRM's dot interaction, per element of its vectors and per
  entry of their products (`fit_interaction_costs`, `dot_interaction`).

Problem sizes: `distcache.tools.microbench.CalibrationSizes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from distcache.errors import DistcacheConfigError
from distcache.planner.dense import ACTIVATION_IN_PASSES, ACTIVATION_OUT_PASSES
from distcache.tools.microbench import FULL, median_seconds


def measure_dense_flops(
    *,
    batch: int = FULL.mlp_batch,
    widths: Sequence[int] = FULL.mlp_widths,
    repeats: int = 5,
    device: str = "cpu",
) -> float:
    """Achieved FLOP/s of an MLP (Linear + ReLU layers) forward + backward.

    Counted as 6 * batch * in * out per layer: 2 for the forward matmul, 4 for the two backward
    ones (input and weight gradients); bias and ReLU are not counted.

    Args:
        batch: Rows of the input.
        widths: Layer widths, input first.
        repeats: Timed steps; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    dev = torch.device(device)
    layers: list[torch.nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers).to(dev)
    x = torch.randn(batch, widths[0], device=dev, requires_grad=True)  # [batch, widths[0]]

    def step() -> None:
        mlp(x).sum().backward()

    flops = sum(6 * batch * a * b for a, b in zip(widths[:-1], widths[1:], strict=True))
    return flops / median_seconds(step, dev, repeats)


def measure_dense_layer_overhead(
    *, layers: int = 8, repeats: int = 5, device: str = "cpu"
) -> float:
    """Seconds per layer of a step of an MLP too small to compute anything (batch 4, width 4,
    Linear + ReLU layers): forward, backward and an SGD update — the dispatch cost a layer
    adds to every step, whatever its size.

    Args:
        layers: Linear layers of the MLP.
        repeats: Timed steps; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    return _mlp_step_seconds(4, (4,) * (layers + 1), repeats, device) / layers


def measure_activation_bandwidth(
    *,
    batch: int = FULL.activation_batch,
    widths: Sequence[int] = FULL.activation_widths,
    flops_per_s: float,
    layer_overhead_s: float,
    repeats: int = 5,
    device: str = "cpu",
) -> float | None:
    """Bytes/s of the activation traffic of an MLP step (forward, backward, SGD update), as
    the cost model counts it (per layer of i inputs and o outputs, batch·4·(3·i + 7·o) bytes):
    its time less its flops at `flops_per_s` and its layers at `layer_overhead_s`. A narrow,
    deep MLP on a large batch makes the traffic most of the time; None if nothing is left.

    Args:
        batch: Rows of the input.
        widths: Layer widths, input first.
        flops_per_s: `measure_dense_flops`'s rate.
        layer_overhead_s: `measure_dense_layer_overhead`'s cost.
        repeats: Timed steps; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    pairs = list(zip(widths[:-1], widths[1:], strict=True))
    seconds = _mlp_step_seconds(batch, widths, repeats, device)
    seconds -= sum(6 * batch * i * o for i, o in pairs) / flops_per_s
    seconds -= len(pairs) * layer_overhead_s
    elements = sum(ACTIVATION_IN_PASSES * i + ACTIVATION_OUT_PASSES * o for i, o in pairs)
    return batch * elements * 4 / seconds if seconds > 0 else None


@dataclass(frozen=True, kw_only=True)
class InteractionCosts:
    """DLRM's dot interaction of F vectors of D dims, forward + backward, per sample:
    `F·D·s_per_element + F²·s_per_pair` seconds."""

    s_per_element: float
    s_per_pair: float


def fit_interaction_costs(
    shapes: Sequence[tuple[int, int]], batch: int, seconds: Sequence[float]
) -> InteractionCosts:
    """Fit `seconds = batch·(F·D·a + F²·b)` to the interaction's times at (F, D) `shapes`,
    minimizing the relative error; a non-positive b (noise, or products that cost only by
    their elements) refits with a alone, so a > 0 and b >= 0.

    Args:
        shapes: (F, D) per measurement.
        batch: Samples per step.
        seconds: Measured seconds per step at each shape.
    """
    t = np.asarray(seconds, dtype=np.float64)
    if len(shapes) != t.size or t.size < 2 or (t <= 0).any():
        raise DistcacheConfigError(
            f"need >= 2 ((F, D), seconds > 0) pairs, got {list(shapes)}, {list(t)}"
        )
    f = np.array([s[0] for s in shapes], dtype=np.float64)
    d = np.array([s[1] for s in shapes], dtype=np.float64)
    design = np.stack([batch * f * d, batch * f * f], axis=1) / t[:, None]  # rows: model / t = 1
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if a <= 0 or b <= 0:
        (a,), *_ = np.linalg.lstsq(design[:, :1], np.ones_like(t), rcond=None)
        b = 0.0
    return InteractionCosts(s_per_element=float(a), s_per_pair=float(b))


def measure_interaction_costs(
    *,
    batch: int = FULL.interaction_batch,
    shapes: Sequence[tuple[int, int]] = FULL.interaction_shapes,
    repeats: int = 5,
    device: str = "cpu",
) -> InteractionCosts:
    """DLRM's dot interaction forward + backward with the assembly of its input, timed at each
    (F, D) of `shapes`, fitted by `fit_interaction_costs`: the collection's pooled output,
    one `[B, (F-1)·D]` tensor, split per feature and concatenated into `[B, F-1, D]`
    (`sparse_vectors`, as TorchRec's `SparseArch` does with the KeyedTensor), then
    `dot_interaction` (TorchRec's `InteractionArch`: the F vectors of a sample stacked, their
    products by a batched matmul, the upper triangle's pairs gathered beside the dense
    vector). Its products are small matrices, which a CPU multiplies far below an MLP's rate
    (here 6-20 GFLOP/s against 94); the step's cost follows the vectors' elements (the
    assembly adds 10-16 % here).

    Args:
        batch: Samples per step.
        shapes: (F vectors, D dims) to time.
        repeats: Timed steps per shape; the median is kept.
        device: 'cpu' or 'cuda'.
    """
    dev = torch.device(device)
    seconds = []
    for features, dim in shapes:
        dense = torch.randn(batch, dim, device=dev, requires_grad=True)  # [batch, D]
        pooled = torch.randn(batch, (features - 1) * dim, device=dev, requires_grad=True)

        def step(dense=dense, pooled=pooled, features=features, dim=dim) -> None:
            sparse = sparse_vectors(pooled, features - 1, dim)
            dot_interaction(dense, sparse).sum().backward()

        seconds.append(median_seconds(step, dev, repeats))
    return fit_interaction_costs(shapes, batch, seconds)


def sparse_vectors(pooled: torch.Tensor, features: int, dim: int) -> torch.Tensor:
    """`[B, features, dim]` from a collection's pooled output `[B, features·dim]`, as TorchRec's
    `SparseArch` builds it: the KeyedTensor's per-feature column views, concatenated."""
    return torch.cat(pooled.split(dim, dim=1), dim=1).reshape(-1, features, dim)


def dot_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """DLRM's dot interaction as TorchRec's `InteractionArch` computes it (without TorchRec,
    which a GPU machine may lack): `dense` [B, D] and `sparse` [B, F - 1, D] give
    [B, D + F(F-1)/2], the dense vector beside the upper triangle of the F vectors' products."""
    vectors = torch.cat((dense.unsqueeze(1), sparse), dim=1)  # [B, F, D]
    features = vectors.shape[1]
    rows, cols = torch.triu_indices(features, features, offset=1, device=dense.device)
    products = torch.bmm(vectors, vectors.transpose(1, 2))  # [B, F, F]
    return torch.cat((dense, products[:, rows, cols]), dim=1)


def _mlp_step_seconds(batch: int, widths: Sequence[int], repeats: int, device: str) -> float:
    """Median seconds of an MLP step: forward, backward, SGD update."""
    dev = torch.device(device)
    layers: list[torch.nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers).to(dev)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=1e-6)
    x = torch.randn(batch, widths[0], device=dev)  # [batch, widths[0]]

    def step() -> None:
        optimizer.zero_grad()
        mlp(x).sum().backward()
        optimizer.step()

    return median_seconds(step, dev, repeats)
