"""TorchRec's sharded collections with distcache's lookups: `ShardedCachedEmbeddingBagCollection`
(pooled, `EmbeddingBagCollection`) and `ShardedCachedEmbeddingCollection` (per-id,
`EmbeddingCollection`).

Input and output distribution are TorchRec's, unchanged; only the lookups differ. A pipeline
that routes a batch's input ahead hands it to the module with `routed`, and `forward` then
looks it up without routing it again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.types import Awaitable, NoWait, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from distcache.cache import fused
from distcache.cache.config import CacheConfig
from distcache.cache.counters import CacheStats
from distcache.cache.ids import find_invalid_per_feature, first_invalid, raise_if_invalid
from distcache.cache.streams import DeviceInts, HostCopy, current_on, keep_all_for
from distcache.errors import (
    InvalidBatchError,
    InvalidIdError,
    LookaheadWindowError,
    UnsupportedError,
)
from distcache.sharding.compact_dist import CompactPooledEmbeddingDist
from distcache.sharding.hot_setup import HotRowsSetup
from distcache.sharding.kernel import (
    CachedEmbeddingBagKernel,
    CachedEmbeddingKernel,
)
from distcache.sharding.lookup import CachedGroupedLookup, CachedGroupedSequenceLookup
from distcache.sharding.parameter_sharding import (
    CACHED_KERNEL,
    FUSED_KERNEL,
    CachedParameterSharding,
)
from distcache.sharding.state import shards_pinned_as_they_are
from distcache.sharding.torchrec_private import (
    grouped_configs,
    sharding_device,
    sharding_env,
    sharding_process_group,
    with_values,
)

_SHARDING_TYPE = {
    "TwPooledEmbeddingSharding": ShardingType.TABLE_WISE,
    "RwPooledEmbeddingSharding": ShardingType.ROW_WISE,
    "CwPooledEmbeddingSharding": ShardingType.COLUMN_WISE,
    "TwCwPooledEmbeddingSharding": ShardingType.TABLE_COLUMN_WISE,
    "TwRwPooledEmbeddingSharding": ShardingType.TABLE_ROW_WISE,
}


@dataclasses.dataclass(frozen=True)
class RoutedInput:
    """A batch's input to one sharded module, routed ahead of the batch's forward (by
    `LookaheadTrainPipeline`): what the module's `input_dist` hands out within `routed`."""

    features: KeyedJaggedTensor  # the batch's sparse input, as the model calls the module
    ctx: Multistreamable  # the module's context for the batch (`create_context`)
    dist_input: KJTList  # what its input dist delivered: this rank's ids, per sharding
    path: str  # the module's path in the user's model, for messages


class CachedShardedModule(HotRowsSetup):
    """What a distcache-sharded collection adds to TorchRec's sharded module (mixed in before
    it): id checks in `input_dist`, the cached kernels, staging ahead, cache counters, and an
    `input_dist` that hands out a batch's input routed ahead (`routed`).

    Ids are validated in `input_dist`, on the rank whose batch holds them and before they are
    routed, without reading the device back: an out-of-range or negative id is replaced by row
    0 for routing (TorchRec's default bounds check does the same, with a warning) and recorded;
    `compute_and_output_dist` raises `InvalidIdError` for that batch before any lookup, so the
    batch is never trained and no row is updated. This rank's caches then drop their window.
    """

    check_ids: bool = True
    fused_ids: bool = False  # ids checked by the C kernels (`fused.check`; CPU)
    _collection: str  # the TorchRec collection's name, for messages
    _lookups: list[nn.Module]
    module_sharding_plan: dict

    _configs_attr: str  # where TorchRec's sharded module keeps its table configs

    def _table_configs(self) -> list:
        """The collection's TorchRec table configs."""
        return getattr(self, self._configs_attr)

    _routed_input: RoutedInput | None = None  # set within `routed`

    @contextlib.contextmanager
    def routed(self, batch: RoutedInput) -> Iterator[None]:
        """Within it, `input_dist` hands out `batch`'s input routed ahead instead of routing
        the features it is called with again (TorchRec's `PipelinedForward` does the same from
        its pipeline's context): so does `forward`, TorchRec's, and the forward of a sharded
        module that routes through this one's `input_dist` (TorchRec's
        `FeatureProcessedEmbeddingBagCollection`). Outside it, `input_dist` routes."""
        self._routed_input = batch
        try:
            yield
        finally:
            self._routed_input = None

    def _routed_ahead(self, ctx, features, routed: RoutedInput) -> Awaitable:  # noqa: ANN001
        """`input_dist` within `routed`: the batch's routed input, its context's state copied
        into `ctx` (the caller's, made by `create_context`), once `features` are the batch's."""
        if features is not routed.features and (
            list(features.keys()) != list(routed.features.keys())
            or features.values().numel() != routed.features.values().numel()
        ):
            raise LookaheadWindowError(
                f"the sharded module {routed.path!r} was called with features other than the "
                "batch's sparse input (sparse_input): the pipeline routed a different batch"
            )
        vars(ctx).update(vars(routed.ctx))
        return NoWait(NoWait(routed.dist_input))

    @functools.cached_property
    def _device_ints(self) -> DeviceInts:
        """Per-feature host ints on the device, built once per value (no host wait)."""
        return DeviceInts()

    @functools.cached_property
    def _rows_by_keys(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        """`_rows_of_keys`' lists, by the batch keys they were made for."""
        return {}

    @functools.cached_property
    def _missing_by_keys(self) -> dict[tuple[str, ...], list[str]]:
        """The module's features a batch of these keys lacks (`_check_batch`), by its keys."""
        return {}

    def input_dist(self, ctx, features):  # noqa: ANN001, ANN201
        if self._routed_input is not None:
            return self._routed_ahead(ctx, features, self._routed_input)
        one_pass = False
        if isinstance(features, KeyedJaggedTensor):
            one_pass = self.check_ids and self._checks_in_one_pass(features)
            self._check_batch(features, lengths=not one_pass)  # (one pass: with the ids)
            device = features.values().device
            if device.type == "cuda":  # TorchRec's pipelines route on a stream of their own
                ctx.distcache_stream = current_on(device)
        if self.check_ids and isinstance(features, KeyedJaggedTensor):
            # The batch's own keys travel with its check (the pipeline routes later batches
            # before this one is looked up).
            ctx.distcache_keys = features.keys()
            checked = self._check_feature_ids(features, one_pass=one_pass)
            features, ctx.distcache_check, ctx.distcache_checked = checked
        if self._hot is not None and isinstance(features, KeyedJaggedTensor):
            features, ctx.distcache_hot = self._hot.split(features)  # hot ids stay here
            ctx.distcache_cold = (features.keys(), features.lengths())
            routing = super().input_dist(ctx, features)  # type: ignore[misc]
            routing.callbacks.append(functools.partial(_note_routed_weights, ctx))
            return routing
        return super().input_dist(ctx, features)  # type: ignore[misc]

    def _check_weights_as_routed(self, ctx, features: KJTList) -> None:  # noqa: ANN001
        """With hot rows, a batch's hot ids are taken out, with their weights, before the rest
        is routed: weights set after routing, as TorchRec's
        `FeatureProcessedEmbeddingBagCollection` sets its position weights, would miss them.
        Refused in one line (where the routed ids were noted: `_note_routed_weights`)."""
        routed = getattr(ctx, "distcache_routed_weights", None)
        if routed is not None and any(
            kjt.weights_or_none() is not weights
            for kjt, weights in zip(features, routed, strict=True)
        ):
            raise UnsupportedError(
                f"{self._collection} with hot rows (CacheConfig.hot_rows) got weights set after "
                "its ids were routed (TorchRec's FeatureProcessedEmbeddingBagCollection sets its "
                "position weights so): the hot ids, taken out before routing, would not get "
                "them. Give this collection's tables no hot rows."
            )

    def _keep_context_here(self, ctx) -> None:  # noqa: ANN001
        """The tensors distcache added to a batch's context on the stream that routed it, kept
        for the current stream where that is another one: TorchRec's pipelines record their
        own context's tensors for the stream that computes the batch, not these."""
        routed_on = getattr(ctx, "distcache_stream", None)
        if routed_on is not None:
            here = torch.cuda.current_stream(routed_on.device_index)  # (by index: `Streams`)
            if here != routed_on:
                extras = ("distcache_checked", "distcache_hot", "distcache_cold")
                keep_all_for([getattr(ctx, name, None) for name in extras], here)

    def compute_and_output_dist(self, ctx, input):  # noqa: ANN001, ANN201, A002
        self._keep_context_here(ctx)
        self._check_weights_as_routed(ctx, input)
        check = getattr(ctx, "distcache_check", None)
        if check is not None:
            try:
                count = check.read()[0]
                if count:  # (the error path: the batch's ids are read on the host)
                    keys = ctx.distcache_keys
                    raise_if_invalid(
                        first_invalid(*ctx.distcache_checked, count=count),
                        lambda k: self._rows_of_key_name(keys[k]),
                        lambda k: self._describe_key(keys[k]),
                    )
            except InvalidIdError:
                for kernel in self.cached_kernels():
                    kernel.bags.drop_window()
                raise
        cold = getattr(ctx, "distcache_cold", None)
        for i, output_dist in enumerate(self._output_dists):
            if isinstance(output_dist, CompactPooledEmbeddingDist) and cold is not None:
                output_dist.prepare(input[i].lengths(), *cold)
        out = super().compute_and_output_dist(ctx, input)  # type: ignore[misc]
        part = getattr(ctx, "distcache_hot", None)
        if part is not None and self._hot.sequence:  # per-id outputs
            hot = self._hot
            rows = hot.rows(part)
            out.callbacks.append(lambda per_key: hot.combine_sequence(per_key, part, rows))
        elif part is not None:
            hot = self._hot
            pooled = hot.pooled(part)
            out.callbacks.append(lambda kt: hot.combine(kt, part, pooled))
        return out

    def _check_batch(self, features: KeyedJaggedTensor, *, lengths: bool = True) -> None:
        """Raise `InvalidBatchError` for a batch TorchRec would fail on later, or train wrongly:
        a feature of the module missing, features of different batch sizes (variable batch),
        ids that are not integers, and (for a batch still in host memory, where it costs no
        device read; `lengths`: here, else with the ids, `_check_feature_ids`) lengths that do
        not add up to the ids. Extra keys are allowed, as TorchRec's collections allow them."""
        keys = features.keys()
        missing = _kept_per_keys(
            self._missing_by_keys, keys, lambda: [f for f in self._feature_rows() if f not in keys]
        )
        if missing:
            raise InvalidBatchError(
                f"the batch lacks feature(s) {missing} of this {self._collection} (rank "
                f"{dist.get_rank()}); its features are {list(self._feature_rows())}, the batch "
                f"has {keys}"
            )
        if features.variable_stride_per_key():
            sizes = dict(zip(features.keys(), features.stride_per_key(), strict=True))
            raise InvalidBatchError(
                f"the batch's features have batch sizes {sizes} (TorchRec's variable batch "
                "KeyedJaggedTensor, stride_per_key_per_rank): distcache's kernels need one batch "
                "size for every feature"
            )
        values = features.values()
        if values.is_floating_point() or values.dtype == torch.bool or values.is_complex():
            raise InvalidBatchError(
                f"the batch's ids are {values.dtype}: ids must be torch.int64 or torch.int32 "
                f"(features {features.keys()})"
            )
        weights = features.weights_or_none()
        if weights is not None and (
            not weights.is_floating_point() or weights.numel() != values.numel()
        ):
            raise InvalidBatchError(
                f"the batch's weights are {weights.numel()} {weights.dtype} values for "
                f"{values.numel()} ids: a weighted feature needs one floating-point weight per id"
            )
        length = features.lengths()
        if lengths and values.device.type == "cpu" and length.device.type == "cpu":
            negative = length.numel() > 0 and int(length.min()) < 0
            _check_lengths(features, int(length.sum()), negative)

    def _check_feature_ids(
        self, features: KeyedJaggedTensor, *, one_pass: bool = False
    ) -> tuple[KeyedJaggedTensor, HostCopy, tuple[torch.Tensor, ...]]:
        """The features with invalid ids replaced by 0, the invalid-id count on its way to the
        host, and what `first_invalid` needs to name the first invalid id, should it be one.
        `one_pass` (where `_checks_in_one_pass`): the lengths checked in the same C call, and
        `InvalidBatchError` raised for them as `_check_batch` does; a batch whose ids are all
        valid is then returned as it is (its count, in host memory, read at once)."""
        keys = features.keys()
        values = features.values()
        device = values.device
        rows = self._device_ints(self._rows_of_keys(keys), device)
        if one_pass:  # (host memory: its counts are read without waiting)
            ids_per_key, count, summary = fused.check_batch(
                self._native, features.lengths(), values, rows, features.stride()
            )
            total, negative = summary.tolist()
            _check_lengths(features, total, bool(negative))
            if not count.tolist()[0]:  # every id valid: the batch goes on as it is
                return features, HostCopy(count), (values, ids_per_key, rows)
            checked_values, _ = fused.check(self._native, values, ids_per_key, rows)
        else:
            ids_per_key = self._ids_per_key(features)
            found = self._native if device.type == "cpu" else {}
            if "check" in found and values.dtype == torch.int64:  # the C kernels' (CPU)
                checked_values, count = fused.check(found, values, ids_per_key, rows)
            else:
                bad, count = find_invalid_per_feature(values, ids_per_key, rows)
                checked_values = torch.where(bad, 0, values)
        # A copy: the caller's batch is left as it was.
        return with_values(features, checked_values), HostCopy(count), (values, ids_per_key, rows)

    def _checks_in_one_pass(self, features: KeyedJaggedTensor) -> bool:
        """Whether `_check_feature_ids` checks the lengths and the ids of `features` in one C
        call (`fused.check_batch`): C kernels on, int64 ids and int32 or int64 lengths in host
        memory, one batch size for every key, one length a bag."""
        if not self.fused_ids or "check_batch" not in self._native:
            return False
        values, lengths = features.values(), features.lengths()
        return (
            values.dtype == torch.int64
            and lengths.dtype in (torch.int32, torch.int64)
            and values.device.type == "cpu"
            and lengths.device.type == "cpu"
            and values.is_contiguous()
            and lengths.is_contiguous()
            and not features.variable_stride_per_key()
            and lengths.numel() == len(features.keys()) * features.stride()
        )

    @property
    def _native(self) -> dict:
        """The fused kernels on CPU (`fused.kernels`: the C ones where a compiler built them)
        where `fused_ids`, else none."""
        return self._cpu_kernels if self.fused_ids else {}

    @functools.cached_property
    def _cpu_kernels(self) -> dict:
        return fused.kernels(torch.device("cpu"))

    def _ids_per_key(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """How many ids each key of `features` holds `[keys]` int64, on its device: the sums of
        its lengths over each key's bags (strides are host ints)."""
        lengths = features.lengths()
        strides = features.stride_per_key()
        if not features.variable_stride_per_key():  # every key has the same bags
            bags = lengths.reshape(len(strides), strides[0] if strides else 0)
            return bags.sum(1, dtype=torch.int64)
        ends = self._device_ints(list(itertools.accumulate(strides)), lengths.device)
        ids_before = F.pad(lengths.cumsum(0, dtype=torch.int64), (1, 0))  # [bags + 1]
        return ids_before.index_select(0, ends).diff(prepend=ends.new_zeros(1))

    def _rows_of_keys(self, keys: list[str]) -> tuple[int, ...]:
        """`_rows_of_key_name` of each key, kept per list of keys (a batch's keys repeat)."""
        return _kept_per_keys(
            self._rows_by_keys, keys, lambda: tuple(self._rows_of_key_name(k) for k in keys)
        )

    def _feature_rows(self) -> dict[str, tuple[str, int]]:
        """Per feature of the collection, in its order: its table's name and rows."""
        if not hasattr(self, "_rows_of_feature"):
            self._rows_of_feature = {
                f: (c.name, c.num_embeddings)
                for c in self._table_configs()
                for f in c.feature_names
            }
        return self._rows_of_feature

    def _rows_of_key_name(self, key: str) -> int:
        return self._feature_rows().get(key, (None, torch.iinfo(torch.int64).max))[1]

    def _describe_key(self, key: str) -> str:
        table = self._feature_rows().get(key, (None, 0))[0]
        return f"table {table!r} (feature {key!r}, rank {dist.get_rank()})"

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        # TorchRec skips state-dict plumbing for customized kernels. Ours expose ShardedTensor
        # state dicts and parameters by table exactly as its fused kernels do, so let TorchRec
        # treat them as such while it builds the module's state.
        saved = self.module_sharding_plan
        patched = copy.copy(saved)
        for name, sharding in saved.items():
            if sharding.compute_kernel == CACHED_KERNEL:
                twin = copy.copy(sharding)
                twin.compute_kernel = FUSED_KERNEL
                patched[name] = twin
        self.module_sharding_plan = patched
        # (TorchRec 1.6, the GPU machine's, has no `skip_registering` for sequence tables)
        args = (skip_registering,) if skip_registering else ()
        try:
            with shards_pinned_as_they_are():  # on CUDA the host rows are page-locked
                super()._initialize_torch_state(*args)  # type: ignore[misc]
        finally:
            self.module_sharding_plan = saved

    def _lookup_modules(self) -> list[nn.Module]:
        """Every module of this rank's lookups (TorchRec keeps them in a plain list, some
        wrapped in DDP)."""
        modules = []
        for lookup in self._lookups:
            while isinstance(lookup, DistributedDataParallel):
                lookup = lookup.module
            modules += list(lookup.modules())
        return modules

    def cached_kernels(self) -> list[CachedEmbeddingBagKernel | CachedEmbeddingKernel]:
        """This rank's distcache kernels."""
        return [
            m
            for m in self._lookup_modules()
            if isinstance(m, (CachedEmbeddingBagKernel, CachedEmbeddingKernel))
        ]

    def planned_cache_configs(self) -> list[CacheConfig]:
        """The `CacheConfig` of every table of the collection on distcache's kernel, whichever
        rank holds it: the same list on every rank (a rank may hold no cached shard)."""
        return [
            sharding.cache_config
            for sharding in self.module_sharding_plan.values()
            if isinstance(sharding, CachedParameterSharding)
            and sharding.compute_kernel == CACHED_KERNEL
            and sharding.cache_config is not None
        ]

    def stage_ahead(self) -> None:
        """Stage enqueued batches' rows up to each cache's `prefetch_depth` batches ahead."""
        for kernel in self.cached_kernels():
            kernel.bags.prefetch()

    def cache_stats(self) -> dict[str, CacheStats]:
        """Cache counters of this rank, per cache (tables of one width in a group share one)."""
        stats = {}
        for kernel in self.cached_kernels():
            stats.update(kernel.bags.stats())
        return stats


def _note_routed_weights(ctx, ids: Awaitable[KJTList]) -> Awaitable[KJTList]:  # noqa: ANN001
    """When the routed ids arrive, note their weights in `ctx` (`_check_weights_as_routed`)."""

    def note(routed: KJTList) -> KJTList:
        ctx.distcache_routed_weights = [kjt.weights_or_none() for kjt in routed]
        return routed

    ids.callbacks.append(note)
    return ids


class ShardedCachedEmbeddingBagCollection(CachedShardedModule, ShardedEmbeddingBagCollection):
    """A sharded `EmbeddingBagCollection` whose `customized_kernel` tables are cached (see
    `CachedShardedModule` for what is checked and when)."""

    _collection = "EmbeddingBagCollection"
    _configs_attr = "_embedding_bag_configs"

    def _create_lookups(self) -> None:
        for sharding in self._embedding_shardings:
            kind = _SHARDING_TYPE.get(type(sharding).__name__)
            if kind is None:  # data parallel: TorchRec's dense lookup, wrapped in DDP later
                self._lookups.append(sharding.create_lookup())
                continue
            self._lookups.append(
                CachedGroupedLookup(
                    grouped_configs=grouped_configs(sharding),
                    pg=sharding_process_group(sharding),
                    device=self._device or sharding_device(sharding),
                    sharding_type=None if kind == ShardingType.TABLE_WISE else kind,
                    env=sharding_env(sharding),
                )
            )


class ShardedCachedEmbeddingCollection(CachedShardedModule, ShardedEmbeddingCollection):
    """A sharded `EmbeddingCollection` whose `customized_kernel` tables are cached: per-id
    rows through the same look-ahead caches (see `CachedShardedModule`)."""

    _collection = "EmbeddingCollection"
    _configs_attr = "_embedding_configs"

    def _create_lookups(self) -> None:
        for sharding in self._sharding_type_to_sharding.values():
            if isinstance(sharding, DpSequenceEmbeddingSharding):  # wrapped in DDP later
                self._lookups.append(sharding.create_lookup())
                continue
            self._lookups.append(
                CachedGroupedSequenceLookup(
                    grouped_configs=grouped_configs(sharding),
                    pg=sharding_process_group(sharding),
                    device=self._device or sharding_device(sharding),
                    env=sharding_env(sharding),
                )
            )


def cache_stats(model: nn.Module) -> dict[str, CacheStats]:
    """Cache counters of this rank for every distcache-sharded module of `model` (e.g. a DMP),
    keyed by `module path/tables`, the path as in the user's model (`ebc/user`), as
    `LookaheadTrainPipeline.stats()` names them."""
    stats = {}
    for path, module in model.named_modules():
        if isinstance(module, CachedShardedModule):
            prefix = f"{user_path(path)}/" if user_path(path) else ""
            for name, s in module.cache_stats().items():
                stats[prefix + name] = s
    return stats


def user_path(path: str) -> str:
    """A module's path in the user's model: without DMP's and DDP's wrapper prefixes
    (`_dmp_wrapped_module.module.ebc` -> `ebc`)."""
    parts = path.split(".")
    while parts and parts[0] in ("_dmp_wrapped_module", "module"):
        parts.pop(0)
    return ".".join(parts)


T = TypeVar("T")


def _kept_per_keys(kept: dict, keys: list[str], make: Callable[[], T]) -> T:
    """`make()` for a batch's `keys`, kept in `kept` by them (a batch's keys repeat from batch
    to batch; at most 64 lists are kept)."""
    value = kept.get(tuple(keys))
    if value is None:
        if len(kept) >= 64:
            kept.clear()
        value = kept[tuple(keys)] = make()
    return value


def _check_lengths(features: KeyedJaggedTensor, total: int, negative: bool) -> None:
    """`InvalidBatchError` where a batch's lengths, adding up to `total` (some `negative`), do
    not give its ids."""
    if negative or total != features.values().numel():
        raise InvalidBatchError(
            f"the batch's lengths add up to {total} ids"
            + (" and some are negative" if negative else "")
            + f" but it holds {features.values().numel()} ids (features {features.keys()}): "
            "lengths must be >= 0 and sum to the number of values"
        )
