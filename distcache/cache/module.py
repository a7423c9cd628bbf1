"""`CachedEmbeddingBags`: pooled embedding lookups through look-ahead caches, without TorchRec.

Input layout is FBGEMM's table-batched one: `values` `[n]` holds the ids of every bag, feature
major (all bags of feature 0, then feature 1, ...), and `offsets` `[F * B + 1]` delimits the
bags. Each feature looks up one table (`feature_table_map`, by default feature i -> table i;
several features may share a table, as in TorchRec). The output is `[B, sum of the features'
dims]`, features side by side in order.

Tables of the same width and dtype share one `CacheEngine` (one cache, rows concatenated, as
large as their caches together); other tables get their own. A batch's ids are routed into
each cache's rows (`routing.Router`), enter the caches' windows (`enqueue`), are staged ahead
(`prefetch`) and looked up (`forward`, `pooling.py`). Rows are updated in backward by the
configured fused optimizer, so the module has no parameters for a dense optimizer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from distcache.cache.capacity import log_shortfalls, per_table, shared_capacity
from distcache.cache.config import CacheConfig
from distcache.cache.counters import CacheStats
from distcache.cache.engine import CacheEngine
from distcache.cache.host_store import HostStore
from distcache.cache.ids import raise_if_invalid
from distcache.cache.plan import StagePlan
from distcache.cache.pooling import CachedPooledLookup, pool, pool_aside, pools_batch_major
from distcache.cache.routing import CacheGroup, RoutedBatch, Router
from distcache.cache.streams import tensors_in
from distcache.cache.tables import TableSpec, table_config
from distcache.errors import (
    CacheCapacityError,
    DistcacheConfigError,
    InvalidBatchError,
    InvalidIdError,
    UnknownTableError,
)


class CachedEmbeddingBags(nn.Module):
    """Pooled lookups of host-resident tables through per-width device caches.

    Args:
        tables: the tables; names must be unique.
        config: cache settings shared by all tables (a table's `TableSpec.capacity`, if
            set, sizes its part of the cache instead of `config.capacity`).
        device: where caches and lookups live ("cpu" or a CUDA device).
        seed: seed of the default initialization, uniform(-1/sqrt(rows), 1/sqrt(rows)) as in
            TorchRec.
        feature_table_map: the table of each input feature (default: one feature per table).
        ids_per_batch: the most ids a batch holds for each table (all its features), for every
            table or per table (a sequence, or a mapping by name). With it, a cache that cannot
            hold its batches in flight is raised before the first batch, with a warning
            (`cache.capacity`); without it, such a batch raises `CacheCapacityError`.

    Example::

        bags = CachedEmbeddingBags(
            [TableSpec(name="user", num_embeddings=1_000_000, embedding_dim=64)],
            CacheConfig(capacity=0.02, lookahead=4, prefetch_depth=1, learning_rate=0.1),
        )
        bags.enqueue(next_values, next_offsets)  # ids of a future batch
        bags.prefetch()                           # stage its rows ahead of time
        out = bags(values, offsets)               # [B, 64]; misses were staged already
        out.sum().backward()                      # fused SGD update on the cached rows
    """

    #: Lookups sum bags (a kernel is built for pooled or per-id lookups).
    _pooled = True

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
        super().__init__()
        if not tables:
            raise DistcacheConfigError("CachedEmbeddingBags needs at least one table")
        names = [t.name for t in tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise DistcacheConfigError(f"duplicate table names {dupes}: names must be unique")
        self.tables = list(tables)
        self.config = config
        # K, batches staged ahead of the training one; a train pipeline may lower it.
        self.prefetch_depth = config.prefetch_depth
        self.device = torch.device(device)
        fmap = list(range(len(tables))) if feature_table_map is None else list(feature_table_map)
        if not fmap or any(not 0 <= t < len(tables) for t in fmap):
            raise DistcacheConfigError(
                f"feature_table_map={fmap} is invalid: expected a non-empty list of table "
                f"indices in [0, {len(tables)})"
            )
        self.feature_table_map = fmap
        ids = per_table(ids_per_batch, names)
        self._groups = [
            self._group(
                [i for i, t in enumerate(tables) if (t.embedding_dim, t.dtype) == kind], ids
            )
            for kind in dict.fromkeys((t.embedding_dim, t.dtype) for t in tables)
        ]
        num_features = len(fmap)
        self._in_order = [f for g in self._groups for f in g.features] == list(range(num_features))
        self._anchor = torch.zeros((), requires_grad=True)
        self._routed: deque[RoutedBatch] = deque()  # enqueued batches, oldest first
        self._router = Router(self._groups, self.tables, fmap, config, self.device)
        self._init_weights(seed)

    def _group(self, members: list[int], ids: list[float | None]) -> CacheGroup:
        """The cache of the tables `members` (of one width and dtype; `ids`: each table's ids
        a batch, or None) and how features reach it."""
        tables, fmap, config = self.tables, self.feature_table_map, self.config
        sizes = [tables[i].num_embeddings for i in members]
        parts = [(tables[i], ids[i]) for i in members]
        capacity, short = shared_capacity(
            [(t.name, t.num_embeddings, n, table_config(t, config)) for t, n in parts]
        )
        log_shortfalls(short, "CachedEmbeddingBags")
        first = tables[members[0]]
        engine = CacheEngine(
            num_rows=sum(sizes),
            dim=first.embedding_dim,
            config=config,
            device=self.device,
            name="+".join(tables[i].name for i in members),
            capacity=capacity,
            dtype=first.dtype,
            pooled=self._pooled,
        )
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        features = [f for f, t in enumerate(fmap) if t in members]
        offset = [starts[members.index(t)] if t in members else 0 for t in fmap]
        position = [features.index(f) if f in features else 0 for f in range(len(fmap))]
        return CacheGroup(
            engine=engine,
            tables=members,
            row_offsets=starts,
            features=features,
            feature_row_offset=torch.tensor(offset, device=self.device),
            member=torch.tensor([t in members for t in fmap], device=self.device),
            feature_index=torch.tensor(features, dtype=torch.int64, device=self.device),
            position=torch.tensor(position, device=self.device),
            has_mean=any(tables[fmap[f]].pooling == "mean" for f in features),
        )

    # ------------------------------------------------------------ lookups
    def enqueue(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        """Add a future batch to every cache's look-ahead window.

        Ids are validated on the device: an invalid id raises `InvalidIdError` when its batch is
        looked up (`forward`), before the batch reads a row; it is never loaded or updated.
        """
        self._enqueue_routed(*self._router.route(values, offsets))

    def _enqueue_routed(self, batch: RoutedBatch, check: torch.Tensor | None) -> None:
        for group in self._groups:  # the batch enters every cache or none
            group.engine.check_room()
        streams = self._groups[0].engine.streams
        batch.routed_on = streams.current() if streams.cuda else None
        batch.for_training, batch.check = self.training, check
        self._enter_caches(batch)
        self._routed.append(batch)

    def _enter_caches(self, batch: RoutedBatch) -> None:
        """`batch`'s routed ids enter every cache's look-ahead window (and its check words the
        first's)."""
        for k, (group, part) in enumerate(zip(self._groups, batch.groups, strict=True)):
            group.engine.enqueue(part.ids, batch.check if k == 0 else None)

    def prefetch(self) -> None:
        """Stage enqueued batches' rows, up to `prefetch_depth` batches ahead."""
        for group in self._groups:
            group.engine.prefetch(self.prefetch_depth)

    def forward(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled embeddings `[B, sum of dims]` of a batch.

        The batch must be the oldest enqueued one, if any is enqueued; with an empty window it
        is enqueued and staged now, its misses counted as critical-path misses. In eval mode
        (`eval()`) while the oldest was enqueued in training mode, the batch is an evaluation's
        between a training pipeline's steps: its rows are read where they are now
        (`CacheEngine.read_rows`; the host waits for the staging in flight), and the window
        stays as it is. (`torch.no_grad` alone does not make a lookup an evaluation's.)

        `per_sample_weights` `[n]` (floating point, TorchRec's weighted features): each id's
        row is scaled by its weight in the pooled sum, and its gradient by the same weight. A
        mean bag divides the weighted sum by its number of ids, as FBGEMM does.

        Raises:
            InvalidIdError: an id of the batch is out of its table's range.
            CacheCapacityError: the batch's rows do not fit in a cache beside the batches in
                flight.
            After either, the look-ahead window is empty (its batches are dropped, not
            trained) and every update made so far is kept: enqueue again and go on.
        """
        weights = self._id_weights(per_sample_weights, values.numel())  # checked before any change
        routed, staged = self._next_routed(values, offsets)
        batch_size = (offsets.numel() - 1) // len(self.feature_table_map)
        train = self.training and torch.is_grad_enabled()
        parts = []  # each group's [its features, B, dim]
        for group, batch in zip(self._groups, routed.groups, strict=True):
            engine = group.engine
            id_weights = batch.id_weights(weights, routed.routed_ids)
            plan = self._lookup(engine, routed) if staged else None
            # One group of every feature, in order: pooled straight into the output, where
            # the C kernel can (its gradient read there too).
            whole = len(self._groups) == 1 and self._in_order and plan is not None
            layout = None
            if whole and pools_batch_major(engine, batch, id_weights):
                layout = (batch_size, len(group.features))
            if plan is None:  # an evaluation's batch, beside the window
                pooled = pool_aside(engine, batch, id_weights)
            elif train:
                pooled = CachedPooledLookup.apply(
                    self._anchor, engine, plan, batch, id_weights, layout
                )
            else:
                pooled, _ = pool(engine, plan, batch, id_weights, batch_major=layout)
                engine.release(plan)
            if layout is not None:  # [B, features * dim], the output
                return pooled
            parts.append(pooled.view(len(group.features), batch_size, engine.dim))
        if self._in_order:  # the groups' features in turn: one copy (and backward) per group
            parts = [part.transpose(0, 1).flatten(1) for part in parts]  # [B, features * dim]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        per_feature: list[torch.Tensor | None] = [None] * len(self.feature_table_map)
        for group, part in zip(self._groups, parts, strict=True):
            # unbind: one backward for all features (indexing each would zero-fill a gradient
            # of the whole group per feature)
            for f, row in zip(group.features, part.unbind(0), strict=True):
                per_feature[f] = row
        return torch.cat(per_feature, dim=1)  # type: ignore[arg-type]

    def _next_routed(self, values: torch.Tensor, offsets: torch.Tensor) -> tuple[RoutedBatch, bool]:
        """The batch to look up, and whether it is staged: the oldest enqueued batch, which
        must be this one, out of the window (with an empty window, the batch is enqueued now:
        its misses are staged on the critical path). A lookup in eval mode while the oldest
        batch was enqueued in training mode (a training pipeline's, between its steps) is an
        evaluation's, of another batch: it is routed here and read beside the window, which
        stays as it is."""
        if not self._routed:
            self._enqueue_routed(*self._router.route(values, offsets))
        elif self._routed[0].for_training and not self.training:
            batch, check = self._router.route(values, offsets)
            invalid = 0 if check is None else int(check[0])  # (an evaluation reads it back)
            if invalid:
                record = self._router.first_invalid(batch, invalid)
                raise_if_invalid(record, self._rows_of, self._describe)
            return batch, False
        routed = self._routed[0]  # validated and routed when enqueued
        if routed.num_bags != offsets.numel() - 1 or routed.num_ids != values.numel():
            raise InvalidBatchError(
                f"forward got a batch of {values.numel()} ids in {offsets.numel() - 1} bags that "
                "does not match the oldest enqueued batch: batches must be looked up in the "
                "order they were enqueued (an evaluation between training steps: model.eval())"
            )
        self._keep_for_lookup(routed)
        return self._routed.popleft(), True

    def _keep_for_lookup(self, batch: RoutedBatch) -> None:
        """A batch routed on another stream than the one looking it up (TorchRec's prefetch
        pipeline routes the next batch on a stream of its own): its tensors, freed after its
        backward, keep their memory until this stream's uses of them completed (else the
        routing stream could reuse it while the lookup or the backward still reads it)."""
        if batch.routed_on is None:
            return
        streams = self._groups[0].engine.streams
        here = streams.current()
        if here == batch.routed_on:
            return
        for tensor in tensors_in((batch.groups, batch.checked)):
            streams.keep_for(tensor, here)

    def _id_weights(self, weights: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if weights is None:
            return None
        if weights.numel() != n or not weights.is_floating_point():
            raise InvalidBatchError(
                f"per_sample_weights holds {weights.numel()} {weights.dtype} values for {n} ids: "
                "expected one floating-point weight per id"
            )
        return weights.to(self.device, torch.float32, non_blocking=True).reshape(-1)

    def _lookup(self, engine: CacheEngine, batch: RoutedBatch) -> StagePlan:
        """The engine's next plan for `batch`; after an error, the window is dropped, then it
        is raised."""
        try:
            plan = engine.lookup_plan()
            if plan.host_check is not None and plan.host_check[0]:  # invalid ids: name one
                record = self._router.first_invalid(batch, plan.host_check[0])
                raise_if_invalid(record, self._rows_of, self._describe)
        except (CacheCapacityError, InvalidIdError):
            self.drop_window()
            raise
        return plan

    @property
    def num_enqueued(self) -> int:
        """Batches enqueued and not yet looked up."""
        return len(self._routed)

    def drop_window(self) -> None:
        """Forget every enqueued batch (not trained); cached rows and updates are kept."""
        for group in self._groups:
            group.engine.drop_window()
        self._routed.clear()

    def _rows_of(self, feature: int) -> int:
        return self.tables[self.feature_table_map[feature]].num_embeddings

    def _describe(self, feature: int) -> str:
        return f"table {self.tables[self.feature_table_map[feature]].name!r} (feature {feature})"

    # ------------------------------------------------------------ state
    def flush(self) -> None:
        """Write every dirty cached row back to the host tables."""
        for group in self._groups:
            group.engine.flush()

    def table_weight(self, name: str) -> torch.Tensor:
        """The up-to-date rows `[num_embeddings, dim]` of a table (flushes its cache first)."""
        group, lo, hi = self._locate(name)
        group.engine.flush()
        return group.engine.store.weights[lo:hi]

    def table_state(self, name: str) -> torch.Tensor:
        """The optimizer state `[num_embeddings, state_dim]` of a table (flushed first)."""
        group, lo, hi = self._locate(name)
        group.engine.flush()
        return group.engine.store.state[lo:hi]

    def load_table_weight(self, name: str, weight: torch.Tensor) -> None:
        """Overwrite a table's rows (its group's cache is flushed, then every cache emptied;
        the enqueued batches stay: `reset(keep_window=True)`)."""
        group, lo, hi = self._locate(name)
        expected = (hi - lo, group.engine.dim)
        if tuple(weight.shape) != expected:
            raise DistcacheConfigError(
                f"table {name!r}: weight of shape {tuple(weight.shape)}, expected {expected}"
            )
        group.engine.flush()
        group.engine.store.weights[lo:hi] = weight.to(group.engine.store.weights.dtype)
        self.reset(keep_window=True)  # every cache (the window spans them all)

    def table_slab(self, name: str) -> tuple[HostStore, int, int]:
        """The host store holding a table and the table's rows [lo, hi) in it (not flushed)."""
        group, lo, hi = self._locate(name)
        return group.engine.store, lo, hi

    def reset(self, *, flush: bool = True, keep_window: bool = False) -> None:
        """Empty every cache and the look-ahead window, after writing dirty rows back unless
        `flush=False` (only right when the host rows were just overwritten, e.g. by a load).
        `keep_window`: the enqueued batches stay, their routed ids entering the emptied caches'
        windows again, to be staged anew (new rows under a pipeline's batches, which are data:
        a load between its steps)."""
        for group in self._groups:
            if flush:
                group.engine.flush()
            group.engine.reset()
        if not keep_window:
            self._routed.clear()
        streams = self._groups[0].engine.streams
        for batch in self._routed:
            if batch.routed_on is not None and batch.routed_on != streams.current():
                streams.current().wait_stream(batch.routed_on)  # its ids made there
            self._enter_caches(batch)

    def stats(self) -> dict[str, CacheStats]:
        """Cache counters per engine (tables of one width and dtype share an engine)."""
        return {g.engine.name: g.engine.stats() for g in self._groups}

    @property
    def engines(self) -> list[CacheEngine]:
        return [g.engine for g in self._groups]

    def _locate(self, name: str) -> tuple[CacheGroup, int, int]:
        for group in self._groups:
            for k, t in enumerate(group.tables):
                if self.tables[t].name == name:
                    lo = group.row_offsets[k]
                    return group, lo, lo + self.tables[t].num_embeddings
        raise UnknownTableError(f"no table {name!r}; tables are {[t.name for t in self.tables]}")

    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for group in self._groups:
            for k, t in enumerate(group.tables):
                spec = self.tables[t]
                lo = group.row_offsets[k]
                bound = math.sqrt(1.0 / spec.num_embeddings)
                rows = group.engine.store.weights[lo : lo + spec.num_embeddings]
                rows.uniform_(-bound, bound, generator=gen)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001
        # Flush first (invariant 6): a checkpoint never misses an update held only in a cache.
        for spec in self.tables:
            destination[f"{prefix}{spec.name}.weight"] = self.table_weight(spec.name).clone()
            state = self.table_state(spec.name)
            if state.shape[1]:
                destination[f"{prefix}{spec.name}.optimizer_state"] = state.clone()

    def _load_from_state_dict(  # noqa: ANN001
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        for spec in self.tables:
            key = f"{prefix}{spec.name}.weight"
            if key not in state_dict:
                missing_keys.append(key)
                continue
            group, lo, hi = self._locate(spec.name)
            self.load_table_weight(spec.name, state_dict[key])
            skey = f"{prefix}{spec.name}.optimizer_state"
            if skey in state_dict:
                group.engine.store.state[lo:hi] = state_dict[skey]
            elif group.engine.store.state_dim:
                missing_keys.append(skey)
