"""The lookup of a staged batch in `CachedEmbeddingBags`: its rows pooled per bag from the cache
(torch's `embedding_bag` over the slots, or FBGEMM's TBE), and the autograd function whose
backward applies the fused optimizer to those rows (`CacheEngine.apply_gradients`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from distcache.cache import fused as fused_passes
from distcache.cache.select import pack

if TYPE_CHECKING:
    from distcache.cache.engine import CacheEngine
    from distcache.cache.plan import StagePlan


@dataclass
class GroupBatch:
    """One group's part of a batch, in fixed-shape buffers of the batch's n ids."""

    ids: torch.Tensor  # [n] int64 engine rows; sentinel row for padding and invalid ids
    offsets: torch.Tensor  # [t * B + 1] int64 the group's bags (ids past the last are padding)
    bag_of_id: torch.Tensor  # [n] int64; t * B (one zero-gradient bag past the end) for padding
    bag_divisor: torch.Tensor | None  # [t * B] len for mean bags, 1 for sum bags; None if all sum
    padded: bool  # the group has only some features: its ids were packed and padded
    member: torch.Tensor | None = None  # [n] bool, when padded: the batch's id is the group's
    rank: torch.Tensor | None = None  # [n] int32, when padded: its index among the group's ids
    routed_pad: bool = False  # the batch was padded past its ids (`cuda_graphs`, jagged)

    @property
    def extra_bag(self) -> bool:
        """Some ids are padding, whose bag is one past the end (a zero gradient)."""
        return self.padded or self.routed_pad

    def id_weights(self, weights: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The batch's per-id weights `[n]` (n: its ids with padding) in this group's id
        order (padding weighs 0)."""
        if weights is None:
            return None
        if weights.numel() < n:
            weights = F.pad(weights, (0, n - weights.numel()))
        return pack(self.member, self.rank, weights, n, 0) if self.padded else weights


def pool(
    engine: CacheEngine,
    plan: StagePlan,
    batch: GroupBatch,
    id_weights: torch.Tensor | None = None,
    *,
    train: bool = False,
    batch_major: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pooled rows `[bags, dim]` (float32) of a staged batch, read from the cache, each row
    scaled by its id's weight when there are weights; and, with FBGEMM's kernel in training,
    the bags' sums as its TBE returned them, whose backward updates the rows.

    `batch_major` (batch, features), where `pools_batch_major`: `[batch, features * dim]`
    instead, feature f's bag b at row b (the module's output), pooled there in one C kernel."""
    if batch_major is not None:
        batch_size, features = batch_major
        pooled = fused_passes.pool(
            engine.pool_kernels, engine.weights, plan.id_slots, batch.offsets,
            batch.bag_divisor, batch_size, features,
        )  # fmt: skip
        return pooled, None
    if engine.tbe is not None:
        with torch.enable_grad() if train else torch.no_grad():
            summed = engine.tbe.lookup(
                plan.id_slots, batch.offsets, id_weights, padded=batch.extra_bag
            )
        fused, pooled = (summed if train else None), summed.detach()
    else:
        fused, weights, ids = None, engine.weights, plan.id_slots
        if weights.dtype != torch.float32:  # half rows: summed in float32, as FBGEMM does
            weights = weights.index_select(0, ids).float()  # [n, dim]
            ids = torch.arange(ids.numel(), device=ids.device)
        pooled = F.embedding_bag(
            ids,
            weights,
            batch.offsets,
            mode="sum",
            include_last_offset=True,
            per_sample_weights=id_weights,
        )
    if batch.bag_divisor is not None:
        pooled = pooled / batch.bag_divisor.unsqueeze(1)
    return pooled, fused


def pools_batch_major(
    engine: CacheEngine, batch: GroupBatch, id_weights: torch.Tensor | None
) -> bool:
    """Whether `pool` can pool `batch` into the module's output layout (`batch_major`): the C
    kernel (fp32 rows, CPU), no per-id weights, no padding ids."""
    return engine.pool_kernels is not None and id_weights is None and not batch.extra_bag


def pool_aside(
    engine: CacheEngine, batch: GroupBatch, id_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """`pool` of a batch that is not staged (an evaluation's, beside the window): its rows
    read where they are now (`CacheEngine.read_rows`), pooled as `pool` pools them."""
    rows = engine.read_rows(batch.ids)  # [n, dim] float32
    at = torch.arange(rows.shape[0], device=rows.device)
    pooled = F.embedding_bag(
        at, rows, batch.offsets, mode="sum", include_last_offset=True, per_sample_weights=id_weights
    )
    if batch.bag_divisor is not None:
        pooled = pooled / batch.bag_divisor.unsqueeze(1)
    return pooled


class CachedPooledLookup(torch.autograd.Function):
    """Lookup whose backward applies the fused optimizer to the cached rows.

    `anchor` is a scalar that requires grad, so the output is part of the autograd graph
    although the cache itself is not a parameter. With FBGEMM's kernel, the TBE's own graph
    (kept aside) runs inside this backward, between the engine's check that the batch's rows
    are still pinned and their release.
    """

    @staticmethod
    def forward(ctx, anchor, engine, plan, batch, id_weights, batch_major=None):  # noqa: ANN001
        ctx.engine, ctx.plan, ctx.batch, ctx.id_weights = engine, plan, batch, id_weights
        ctx.batch_major = batch_major
        pooled, ctx.fused = pool(
            engine, plan, batch, id_weights, train=True, batch_major=batch_major
        )
        return pooled

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001
        engine, plan, batch, batch_major = ctx.engine, ctx.plan, ctx.batch, ctx.batch_major
        grad = grad_output
        if batch_major is not None:  # (no per-id weights, no padding: `pools_batch_major`)
            if batch.bag_divisor is not None:  # each bag's at its place: [batch, features, 1]
                batch_size, features = batch_major
                divisor = batch.bag_divisor.view(features, batch_size).t().unsqueeze(2)
                grad = (grad.view(batch_size, features, -1) / divisor).view_as(grad_output)
            engine.apply_gradients(plan, grad, batch.bag_of_id, None, batch_major)
            return None, None, None, None, None, None
        if batch.bag_divisor is not None:
            grad = grad / batch.bag_divisor.unsqueeze(1)
        # Trainable weights (TorchRec's position-weighted features): their gradient from the
        # rows as they were looked up, before this backward updates them.
        weights_grad = (
            _id_weights_grad(engine, plan, batch, grad) if ctx.needs_input_grad[4] else None
        )
        if ctx.fused is not None:
            engine.apply_tbe_gradients(plan, ctx.fused, grad)
            ctx.fused = None  # its graph is spent
            return None, None, None, None, weights_grad, None
        if batch.extra_bag:  # padding ids point at one more bag, whose gradient is zero
            grad = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])
        engine.apply_gradients(plan, grad, batch.bag_of_id, ctx.id_weights)
        return None, None, None, None, weights_grad, None


def _id_weights_grad(
    engine: CacheEngine, plan: StagePlan, batch: GroupBatch, bag_grad: torch.Tensor
) -> torch.Tensor:
    """`[n]` the gradient of each id's weight: its row (float32) dot its bag's gradient
    `bag_grad` `[bags, dim]` (mean scaling applied); 0 for padding ids."""
    rows = engine.weights.index_select(0, plan.id_slots).float()  # [n, dim]
    if batch.extra_bag:  # padding ids point at one more bag, whose gradient is zero
        bag_grad = torch.cat([bag_grad, bag_grad.new_zeros(1, bag_grad.shape[1])])
    return (rows * bag_grad.index_select(0, batch.bag_of_id)).sum(1)
