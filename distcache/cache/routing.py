"""Routing, a batch's first stage in `CachedEmbeddingBags`: its ids, in FBGEMM's
table-batched layout (feature-major bags), split on the device into each cache's engine rows.

Tables of one width and dtype share one `CacheEngine` (a `CacheGroup`). A feature's ids become
rows of its group's engine (its table's first row added); its bags become the group's bags,
packed first where the group serves only some of the features. Ids out of their table's range
go to the engine's sentinel row and are counted in check words (`CacheConfig.check_ids`), which
the lookup reads and `Router.first_invalid` names on the error path. With `cuda_graphs` the
device work is replayed as one graph per batch shape; where one group serves every feature, a
fused kernel does it in one pass (`fused.route`).

Example::

    batch, check = router.route(values, offsets)  # each group's ids, offsets, bags
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distcache.cache import fused
from distcache.cache.config import CacheConfig
from distcache.cache.engine import CacheEngine
from distcache.cache.graphs import GraphCache
from distcache.cache.ids import find_invalid, first_invalid
from distcache.cache.pooling import GroupBatch
from distcache.cache.select import pack
from distcache.cache.tables import TableSpec
from distcache.errors import InvalidBatchError


@dataclass
class CacheGroup:
    """Tables of one width and dtype served by one engine, and the features that look them up."""

    engine: CacheEngine
    tables: list[int]  # indices into the module's tables
    row_offsets: list[int]  # first engine row of each table
    features: list[int]  # indices of the features whose table is in this group
    feature_row_offset: torch.Tensor  # [F] int64 engine row of the feature's row 0 (0: not here)
    member: torch.Tensor  # [F] bool the feature's table is in this group
    feature_index: torch.Tensor  # [len(features)] int64 the group's features
    position: torch.Tensor  # [F] int64 index of the feature among the group's (0: not here)
    has_mean: bool  # some feature of the group pools by mean (decided on the host)

    @property
    def sentinel_row(self) -> int:
        return self.engine.scheduler.residency.sentinel_row


@dataclass
class RoutedBatch:
    """A batch routed (`Router.route`): each group's part, and what the module keeps with it."""

    groups: list[GroupBatch]
    num_ids: int
    num_bags: int
    routed_ids: int  # with padding (`cuda_graphs`, jagged batches); num_ids if none
    # The ids and offsets as checked (`check_ids`), to name an invalid id on the error path.
    checked: tuple[torch.Tensor, torch.Tensor] | None = None
    routed_on: torch.cuda.Stream | None = None  # the stream it was routed on (CUDA)
    for_training: bool = False  # enqueued in training: only training looks it up
    check: torch.Tensor | None = None  # its check words (`Router.route`), as enqueued


class Router:
    """Routes a module's batches into its groups' engine rows (`route`).

    Args:
        groups: the module's caches, in order; their engines' sentinel rows take invalid ids.
        tables: the module's tables.
        feature_table_map: the table of each feature.
        config: `check_ids`, `cuda_graphs` and `fused` are read.
        device: where batches are routed.
    """

    def __init__(
        self,
        groups: list[CacheGroup],
        tables: list[TableSpec],
        feature_table_map: list[int],
        config: CacheConfig,
        device: torch.device,
    ):
        self.groups, self.feature_table_map = groups, feature_table_map
        self.config, self.device = config, device
        # Each feature's table's rows (its ids' range), and whether it pools by mean: [F].
        self.rows = torch.tensor(
            [tables[t].num_embeddings for t in feature_table_map], device=device
        )
        self._mean = torch.tensor(
            [tables[t].pooling == "mean" for t in feature_table_map], device=device
        )
        # Routing replayed as a graph per batch shape (`CacheConfig.cuda_graphs`).
        on_graphs = config.graphs_on(device)
        self.graphs = GraphCache(device, enabled=on_graphs, name="routing")
        whole = len(groups) == 1  # one group serving every feature: `fused.route`
        on = config.fused_on(device) and whole
        self.kernels = fused.kernels(device, graphs=on_graphs) if on else None

    def route(
        self, values: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[RoutedBatch, torch.Tensor | None]:
        """Split a batch into each group's engine rows, on the device; invalid ids go to the
        sentinel row, recorded in the returned check words (None without `check_ids`)."""
        num_features = len(self.feature_table_map)
        num_bags = offsets.numel() - 1
        if num_bags < 0 or num_bags % num_features:
            raise InvalidBatchError(
                f"offsets has {offsets.numel()} entries; expected F * B + 1 with F={num_features} "
                "features (feature-major bags)"
            )
        # From host memory without waiting for the device (a pageable source is copied out
        # before the call returns; a blocking copy would wait for the device's queue).
        values = values.to(self.device, torch.int64, non_blocking=True)
        offsets = offsets.to(self.device, torch.int64, non_blocking=True)
        n = values.numel()
        routed = self.graphs.size(n, num_bags)
        padded_ids = routed > n
        if padded_ids:  # padding ids (value 0) past the last bag: routed to the sentinel row
            values = F.pad(values, (0, routed - n))
        fn = functools.partial(self.route_device, padded_ids=padded_ids)
        flat = iter(self.graphs.run(("route", routed, num_bags, padded_ids), fn, values, offsets))
        parts = []
        for group in self.groups:  # as `route_device` lays its results out
            ids, g_offsets, g_bag_of_id = next(flat), next(flat), next(flat)
            divisor = next(flat) if group.has_mean else None
            padded = len(group.features) < num_features
            keep = (next(flat), next(flat)) if padded else (None, None)
            part = GroupBatch(ids, g_offsets, g_bag_of_id, divisor, padded, *keep, padded_ids)
            parts.append(part)
        check, checked = None, None
        if self.config.check_ids:
            check, checked = next(flat), (values[:n], offsets)
        return RoutedBatch(parts, n, num_bags, routed, checked), check

    def route_device(
        self, values: torch.Tensor, offsets: torch.Tensor, *, padded_ids: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """`route`'s device work (a graph with `cuda_graphs`): per group its ids, offsets,
        bag of each id, then the bags' divisors if it has mean features, then `member` and
        `rank` if it has only some features; then the check words if ids are checked."""
        num_features, n = len(self.feature_table_map), values.numel()
        num_bags = offsets.numel() - 1
        batch_size = num_bags // num_features
        if self.kernels is not None and batch_size:
            return self._route_fused(values, offsets, batch_size, padded_ids)
        lengths = offsets.diff()  # [F * B]
        if not padded_ids:  # repeat_interleave of counts alone: the index of each id's count
            bag_of_id = torch.repeat_interleave(lengths, output_size=n)
            starts = torch.arange(num_features + 1, device=self.device).mul_(batch_size)
            ids_per_feature = offsets.index_select(0, starts).diff()  # [F]

            def per_id(per_feature: torch.Tensor) -> torch.Tensor:  # [F] -> each id's [n]
                return per_feature.repeat_interleave(ids_per_feature, output_size=n)

        else:  # ids past the last bag (n is offsets[-1], on the device): bag num_bags
            at = torch.arange(n, device=self.device)
            bag_of_id = torch.searchsorted(offsets[1:], at, right=True)
            feature_of_id = (bag_of_id // max(batch_size, 1)).clamp_(max=num_features - 1)

            def per_id(per_feature: torch.Tensor) -> torch.Tensor:
                return per_feature.index_select(0, feature_of_id)

        bad, check = None, None
        if self.config.check_ids:
            bad, check = find_invalid(values, per_id(self.rows))
        if padded_ids:
            pad = bag_of_id >= num_bags
            bad = pad if bad is None else bad | pad
        out: list[torch.Tensor] = []
        for group in self.groups:
            ids = values + per_id(group.feature_row_offset)
            if bad is not None:
                ids = torch.where(bad, group.sentinel_row, ids)
            padded = len(group.features) < num_features
            if not padded:
                g_lengths, g_offsets, g_bag_of_id = lengths, offsets, bag_of_id
            else:  # pack the group's ids first (features are feature-major, so bags stay whole)
                member = per_id(group.member)
                if padded_ids:
                    member = member & ~pad
                rank = member.cumsum(0, dtype=torch.int32) - 1
                per_feature = lengths.view(num_features, batch_size)
                g_lengths = per_feature.index_select(0, group.feature_index).reshape(-1)
                g_offsets = torch.cat([offsets[:1] * 0, g_lengths.cumsum(0)])
                position = per_id(group.position)
                local_bag = position * batch_size + bag_of_id % max(batch_size, 1)
                ids = pack(member, rank, ids, n, group.sentinel_row)
                g_bag_of_id = pack(member, rank, local_bag, n, g_lengths.numel())
            out += [ids, g_offsets, g_bag_of_id]
            if group.has_mean:  # decided on the host from the table configs
                out.append(self._divisor(group, g_lengths, batch_size))
            if padded:
                out += [member, rank]
        if check is not None:
            out.append(check)
        return tuple(out)

    def _route_fused(
        self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int, padded_ids: bool
    ) -> tuple[torch.Tensor, ...]:
        """`route_device` by `fused.route`, for one group serving every feature."""
        (group,) = self.groups
        ids, bag_of_id, check = fused.route(
            self.kernels, values, offsets, self.rows, group.feature_row_offset,
            group.sentinel_row, len(self.feature_table_map), padded_ids=padded_ids,
            check_ids=self.config.check_ids,
        )  # fmt: skip
        out = [ids, offsets, bag_of_id]
        if group.has_mean:
            out.append(self._divisor(group, offsets.diff(), batch_size))
        return (*out, check) if check is not None else tuple(out)

    def _divisor(self, group: CacheGroup, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """`[t * B]` float32: each of the group's bags' id count (at least 1) where its
        feature pools by mean, else 1."""
        mean = self._mean.index_select(0, group.feature_index)
        length = lengths.clamp(min=1).to(torch.float32)
        bag_mean = mean.repeat_interleave(batch_size)
        return torch.where(bag_mean, length, torch.ones_like(length))

    def first_invalid(self, batch: RoutedBatch, count: int) -> list[int]:
        """`first_invalid` of a batch whose check counted `count` invalid ids (reads it on the
        host)."""
        values, offsets = batch.checked
        num_features = len(self.feature_table_map)
        starts = torch.arange(num_features + 1) * (batch.num_bags // num_features)
        ids_per_feature = offsets.cpu().index_select(0, starts).diff()
        return first_invalid(values, ids_per_feature, self.rows, count)
