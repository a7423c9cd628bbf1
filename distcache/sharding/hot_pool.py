"""The replica's compute stage (`HotRows.pooled`, `HotRows.rows`, `HotRows.combine`): autograd
functions that pool hot ids' rows from the replica and add them into the collection's output.

The replica is not a parameter: `PooledRows`' backward hands each hot id's gradient row to a
sink (`HotRows` collects them, one entry per embedding dim, and reduces them over the ranks as
sparse rows), and returns a zero gradient for a scalar trigger instead, whose accumulation
tells `HotRows` that the backward is done with the replica (one hook, after every width's
rows are in). No `[H, dim]` gradient is made unless a table's reduction needs it
(`sharding.hot_reduce`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Sink = Callable[[torch.Tensor], None]
"""Takes `[h, dim]`: each hot id's gradient row (its bag's gradient, times its weight)."""


class PooledRows(torch.autograd.Function):
    """Sum pooling of replica rows `weight` `[rows, dim]` into bags: forward by an embedding
    bag; backward gathers each id's bag gradient (scaled by its weight; `bags` None: each id
    is a bag of its own, whose gradient is its row's) and hands it to `sink`, and gives
    `trigger` (a scalar leaf) a zero gradient."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        trigger: torch.Tensor,
        weight: torch.Tensor,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        bags: torch.Tensor,
        sink: Sink,
    ):
        ctx.save_for_backward(weights, bags)
        ctx.sink = sink
        return F.embedding_bag(
            rows, weight, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True
        )

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        weights, bags = ctx.saved_tensors
        per_id = grad if bags is None else grad.index_select(0, bags)  # None: a bag per id
        if weights is not None:
            per_id = per_id * weights.unsqueeze(1)
        ctx.sink(per_id)
        return grad.new_zeros(()), None, None, None, None, None, None


class AddColumns(torch.autograd.Function):
    """Adds each hot feature's pooled rows into its columns of the collection's output, in
    place: a sum bag takes `cold + hot`, a mean bag `(cold * cold_ids + hot) / ids` (as pooling
    all its ids would). One pass over the hot columns, no new output, and a backward that hands
    each feature its columns of the gradient (column slices and a concatenation, under
    autograd, would fill a zero gradient of the whole output per feature)."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        values: torch.Tensor,
        spans: list[tuple[int, int]],
        means: list[tuple[torch.Tensor, torch.Tensor] | None],
        *hots: torch.Tensor,
    ):
        for (start, width), mean, hot in zip(spans, means, hots, strict=True):
            columns = values[:, start : start + width]
            if mean is None:
                columns.add_(hot)
            else:
                cold_ids, total = mean
                columns.copy_((columns * cold_ids + hot) / total)
        ctx.mark_dirty(values)
        ctx.spans, ctx.means = spans, means
        return values

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad_values = grad.clone() if any(m is not None for m in ctx.means) else grad
        grad_hots = []
        for (start, width), mean in zip(ctx.spans, ctx.means, strict=True):
            columns = grad[:, start : start + width]
            if mean is not None:
                cold_ids, total = mean
                columns = columns / total
                grad_values[:, start : start + width] = columns * cold_ids
            grad_hots.append(columns)
        return grad_values, None, None, *grad_hots


class PlaceRows(torch.autograd.Function):
    """Rows from several sources put in their places of one new `[n, dim]` tensor: source i's
    rows `[k_i, dim]` at its `positions[i]` `[k_i]`, the positions of all sources together
    naming every row once (a partition: nothing is zero-filled first). Backward hands each
    source its positions' rows of the gradient. One write of the output and one read of the
    gradient, where out-of-place copies into zeros (and their backward) would pass over all
    n rows several times."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        n: int,
        positions: list[torch.Tensor],
        *sources: torch.Tensor,
    ):
        out = sources[0].new_empty(n, sources[0].shape[1])
        for where, rows in zip(positions, sources, strict=True):
            out.index_copy_(0, where, rows)
        ctx.save_for_backward(*positions)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return None, None, *(grad.index_select(0, where) for where in ctx.saved_tensors)
