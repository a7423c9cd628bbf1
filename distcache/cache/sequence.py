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

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from distcache.cache.config import CacheConfig
from distcache.cache.engine import CacheEngine
from distcache.cache.module import CachedEmbeddingBags, TableSpec
from distcache.cache.plan import StagePlan
from distcache.cache.pooling import GroupBatch
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

    _pooled = False  # FBGEMM's kernel returns each id's row (`PoolingMode.NONE`)

    def __init__(
        self,
        tables: list[TableSpec],
        config: CacheConfig,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
        feature_table_map: list[int] | None = None,
        ids_per_batch: float | Sequence[float] | Mapping[str, float] | None = None,
    ):
        kinds = sorted({(t.embedding_dim, str(t.dtype)) for t in tables})
        if len(kinds) > 1:
            raise DistcacheConfigError(
                f"CachedEmbeddings got tables of widths and dtypes {kinds}: unpooled lookups "
                "need one width and dtype for all tables (as TorchRec's EmbeddingCollection)"
            )
        super().__init__(
            tables,
            config,
            device=device,
            seed=seed,
            feature_table_map=feature_table_map,
            ids_per_batch=ids_per_batch,
        )

    def forward(  # type: ignore[override]
        self, values: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Each id's row `[n, dim]` (float32), in the order of `values`.

        The batch must be the oldest enqueued one, if any is enqueued (see
        `CachedEmbeddingBags.forward`, whose errors and guarantees are the same).
        """
        routed, staged = self._next_routed(values, offsets)
        (group,) = self._groups
        engine = group.engine
        (batch,) = routed.groups
        n = routed.num_ids
        if not staged:  # an evaluation's batch, beside the window: its rows as they are now
            return engine.read_rows(batch.ids)[:n]
        plan = self._lookup(engine, routed)
        # One group, every feature in it: the plan's slots are in input order (then padding,
        # with `cuda_graphs` on jagged batches).
        if self.training and torch.is_grad_enabled():
            return _CachedRowLookup.apply(self._anchor, engine, plan, batch, n)
        rows, _ = _rows(engine, plan, batch)
        engine.release(plan)
        return rows[:n]


def _rows(
    engine: CacheEngine, plan: StagePlan, batch: GroupBatch, *, train: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The staged rows of a batch's ids, padding included `[routed ids, dim]`, read from the
    cache, in float32; and, with FBGEMM's kernel in training, the rows as its TBE returned
    them, whose backward updates the rows."""
    if engine.tbe is None:
        return engine.weights.index_select(0, plan.id_slots).float(), None
    with torch.enable_grad() if train else torch.no_grad():
        rows = engine.tbe.lookup(plan.id_slots, batch.offsets, padded=batch.extra_bag)
    return rows.detach(), (rows if train else None)


class _CachedRowLookup(torch.autograd.Function):
    """Per-id lookup whose backward applies the fused optimizer to the cached rows (with
    FBGEMM's kernel, by the TBE's own graph, as `pooling.CachedPooledLookup`)."""

    @staticmethod
    def forward(ctx, anchor, engine, plan, batch, n):  # noqa: ANN001, ANN205
        ctx.engine, ctx.plan = engine, plan
        rows, ctx.fused = _rows(engine, plan, batch, train=True)
        return rows[:n]

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        grad = grad_output.float()
        padding = ctx.plan.id_slots.numel() - grad.shape[0]
        if padding:  # the padding ids' rows: a zero gradient
            grad = F.pad(grad, (0, 0, 0, padding))
        if ctx.fused is not None:
            ctx.engine.apply_tbe_gradients(ctx.plan, ctx.fused, grad)
            ctx.fused = None  # its graph is spent
        else:
            ctx.engine.apply_gradients(ctx.plan, grad, None)
        return None, None, None, None, None
