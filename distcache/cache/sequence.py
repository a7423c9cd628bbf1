"""`CachedEmbeddings`: unpooled lookups (one row per id) through look-ahead caches.

The sequence counterpart of `CachedEmbeddingBags`, as TorchRec's `EmbeddingCollection` is of
its `EmbeddingBagCollection`: the same input layout (`values`, feature-major `offsets`), the same
routing, look-ahead window, staging and state; `forward` returns each id's row, `[n, dim]` in the
order of `values`, instead of pooling bags. An unpooled lookup is a pooled one whose bags hold
one id each, so the fused row update in backward is the engine's own (duplicate ids' gradients
summed per row, as a dense `nn.Embedding` gradient sums them).

Every table has one width and dtype (TorchRec's `EmbeddingCollection` requires one width; its
grouping gives a kernel one dtype), so the tables share one cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distcache.cache.config import CacheConfig
from distcache.cache.engine import CacheEngine
from distcache.cache.module import CachedEmbeddingBags, TableSpec
from distcache.cache.scheduler import StagePlan
from distcache.errors import DistcacheConfigError


class CachedEmbeddings(CachedEmbeddingBags):
    """Per-id lookups of host-resident tables of one width through one device cache.

    Arguments as `CachedEmbeddingBags`; the tables' `pooling` is not used.

    Example::

        seqs = CachedEmbeddings(
            [TableSpec(name="item", num_embeddings=1_000_000, embedding_dim=64)],
            CacheConfig(capacity=0.02, learning_rate=0.1),
        )
        seqs.enqueue(next_values, next_offsets)  # ids of a future batch
        seqs.prefetch()
        rows = seqs(values, offsets)              # [len(values), 64]
        rows.sum().backward()                     # fused update of the cached rows
    """

    def __init__(
        self,
        tables: list[TableSpec],
        config: CacheConfig,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
        feature_table_map: list[int] | None = None,
    ):
        kinds = sorted({(t.embedding_dim, str(t.dtype)) for t in tables})
        if len(kinds) > 1:
            raise DistcacheConfigError(
                f"CachedEmbeddings got tables of widths and dtypes {kinds}: unpooled lookups "
                "need one width and dtype for all tables (as TorchRec's EmbeddingCollection)"
            )
        super().__init__(
            tables, config, device=device, seed=seed, feature_table_map=feature_table_map
        )

    def forward(  # type: ignore[override]
        self, values: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Each id's row `[n, dim]` (float32), in the order of `values`.

        The batch must be the oldest enqueued one, if any is enqueued (see
        `CachedEmbeddingBags.forward`, whose errors and guarantees are the same).
        """
        routed = self._next_routed(values, offsets)
        (group,) = self._groups
        engine = group.engine
        plan = self._lookup(engine)
        # One group, every feature in it: the plan's slots are in input order (then padding,
        # with `cuda_graphs` on jagged batches).
        n = routed.num_ids
        if self.training and torch.is_grad_enabled():
            return _CachedRowLookup.apply(self._anchor, engine, plan, n)
        rows = _rows(engine.weights, plan)[:n]
        engine.release(plan)
        return rows


def _rows(weights: torch.Tensor, plan: StagePlan) -> torch.Tensor:
    """The staged rows of a batch's ids `[n, dim]`, read from the cache, in float32."""
    return weights.index_select(0, plan.id_slots).float()


class _CachedRowLookup(torch.autograd.Function):
    """Per-id lookup whose backward applies the fused optimizer to the cached rows."""

    @staticmethod
    def forward(ctx, anchor, engine: CacheEngine, plan: StagePlan, n: int):  # noqa: ANN001, ANN205
        ctx.engine, ctx.plan = engine, plan
        return _rows(engine.weights, plan)[:n]

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        grad = grad_output.float()
        padding = ctx.plan.id_slots.numel() - grad.shape[0]
        if padding:  # the padding ids' rows: a zero gradient
            grad = F.pad(grad, (0, 0, 0, padding))
        ctx.engine.apply_gradients(ctx.plan, grad, None)
        return None, None, None, None
