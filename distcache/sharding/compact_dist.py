"""`CompactPooledEmbeddingDist`: the pooled output all-to-all of table- and column-wise shards,
sending only the bags that have ids.

With hot rows (`distcache.sharding.hot_rows`) a bag of a hot table whose ids are all hot reaches
the table's shard empty, and its pooled output there is zero. Both sides know which bags are
empty without asking: the shard from the lengths it was routed, the bag's own rank from the
batch's cold lengths. TorchRec's output dist (`TwPooledEmbeddingDist`) sends every bag's output
anyway, `[B, dims]` from each shard's rank to each batch's rank; this one sends the non-empty
bags' outputs only and rebuilds the same `[B, sum of the ranks' dims]` tensor, zeros for the
empty bags, so the rest of TorchRec (column-wise permutes, the collection's awaitable) sees
what it always does. Exact: an empty bag pools to zero (sum or mean) in TorchRec too.

One batch through it (rank r, world W, B samples per rank)::

    prepare     the shard's routed lengths `[F_r, W * B]` and the batch's cold lengths
    forward     the non-empty bags counted per (peer, feature) on both sides: one read of
                the device for the batch (the all-to-all's split sizes are host ints, as
                TorchRec's input dist reads its own); one gather of the non-empty outputs,
                peer-major; one all-to-all (TorchRec's `AllToAllSingle`: the backward sends
                the gradients back, divided by the world size as TorchRec's own dist does);
                one scatter of what arrived into zeros

The one gather and one scatter give every rank the same autograd graph, whatever its features,
so the ranks run the backward all-to-alls of a collection's shardings in the same order (a
graph shaped by each rank's features did not, and deadlocked); each dist has a process group
of its own. The all-to-all starts when the dist is called and is waited for, and its outputs
scattered, when the awaitable is (as TorchRec's: the dense work between overlaps it).

Used for the table- and column-wise shardings of a collection with hot rows
(`CachedShardedModule.setup_hot_rows`); a variable batch per feature, or batches of different
sizes on the ranks, go through TorchRec's dist. The elements sent are counted
(`elements_sent`, `elements_kept`, `elements_received`, `elements_full`) for tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import AllToAllSingle, get_gradient_division, pg_name
from torchrec.distributed.types import Awaitable

from distcache.cache.streams import DeviceInts
from distcache.errors import UnsupportedError


class _Later(Awaitable[torch.Tensor]):
    """The output, made on wait: `finish` waits for the all-to-all (at the first use of what it
    received) and scatters it."""

    def __init__(
        self,
        finish: Callable[[], torch.Tensor],
        callbacks: list[Callable[[torch.Tensor], torch.Tensor]],
    ):
        super().__init__()
        self._finish = finish
        self.callbacks.extend(callbacks)

    def _wait_impl(self) -> torch.Tensor:
        return self._finish()


class _Scatter(torch.autograd.Function):
    """Rows `[k, d]` into a new `[B, width]` of zeros, seen as `[B * width / d, d]`, at
    `rows`; backward gathers their gradient back. The output is a tensor of its own, not a
    view: the hot rows' part is added into it in place (`hot_pool.AddColumns`), which on a
    view would make autograd copy the whole output's gradient over again in backward."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, rows: torch.Tensor, batch: int, width: int):  # noqa: ANN001, ANN205
        out = src.new_zeros(batch, width)
        out.view(-1, src.shape[1]).index_copy_(0, rows, src)
        ctx.save_for_backward(rows)
        ctx.d = src.shape[1]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (rows,) = ctx.saved_tensors
        return grad.reshape(-1, ctx.d).index_select(0, rows), None, None, None


class CompactPooledEmbeddingDist(nn.Module):
    """The output dist of one table- or column-wise sharding, compacted to non-empty bags.

    Args:
        pg: a process group over the sharding's ranks, for this dist alone.
        features_per_rank: per rank, the features whose pooled outputs it sends, in the order
            of its output columns (`feature_names_per_rank()` of TorchRec's sharding).
        dims_per_rank: per rank, each of those features' output columns.
        fallback: TorchRec's own dist (variable batch per feature goes through it).
        callbacks: TorchRec's dist's callbacks (a column-wise permute), applied on wait.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        features_per_rank: list[list[str]],
        dims_per_rank: list[list[int]],
        fallback: nn.Module,
        callbacks: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ):
        super().__init__()
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._features = features_per_rank
        self._dims = dims_per_rank
        self._fallback = fallback
        self._callbacks = list(callbacks or [])
        self._orders: dict[tuple[str, ...], torch.Tensor] = {}  # by the batch's keys
        self._ints = DeviceInts()  # features' dims on the device
        self._sent_lengths: torch.Tensor | None = None
        self._cold: tuple[list[str], torch.Tensor] | None = None
        # Pooled output elements, cumulative, forward: this rank sent (to itself too), of which
        # it kept (its own split), received, and what TorchRec's dist would have sent.
        self.elements_sent = self.elements_kept = self.elements_received = 0
        self.elements_full = 0

    def prepare(self, sent_lengths: torch.Tensor, keys: list[str], cold: torch.Tensor) -> None:
        """The batch's lengths, before `forward`: `sent_lengths` `[F_r * W * B]` the shard's
        routed lengths (feature-major, then peer, then sample); `keys` and `cold`
        `[len(keys) * B]` this rank's features and their lengths without hot ids."""
        self._sent_lengths, self._cold = sent_lengths, (keys, cold)

    def forward(self, local_embs: torch.Tensor, sharding_ctx=None) -> Awaitable[torch.Tensor]:  # noqa: ANN001
        if sharding_ctx is not None and (
            sharding_ctx.variable_batch_per_feature
            or len(set(sharding_ctx.batch_size_per_rank or [0])) > 1
        ):
            self._sent_lengths = self._cold = None
            return self._fallback(local_embs, sharding_ctx)
        if self._sent_lengths is None or self._cold is None:
            raise UnsupportedError(
                "CompactPooledEmbeddingDist: prepare() must give the batch's lengths before "
                "forward (the sharded module does, in compute_and_output_dist)"
            )
        sent, (keys, cold) = self._sent_lengths, self._cold
        self._sent_lengths = self._cold = None
        world = dist.get_world_size(self._pg)
        mine = self._features[self._rank]
        batch = local_embs.shape[0] // world  # its rows: every peer's samples
        # Bags this rank sends, peer-major: [W, F_r, B]; bags it receives, (peer, feature)
        # in the peers' column order: [sum F_s, B].
        sends = (sent.view(len(mine), world, batch) > 0).transpose(0, 1)
        gets = cold.view(len(keys), batch).index_select(0, self._order(keys, cold.device)) > 0
        counts = torch.cat([sends.sum(2).reshape(-1), gets.sum(1)]).tolist()  # the one read
        sent_counts, got_counts = counts[: world * len(mine)], counts[world * len(mine) :]
        in_splits = _volumes(sent_counts, [self._dims[self._rank]] * world)
        out_splits = _volumes(got_counts, self._dims)
        # One gather of the outputs sent and one scatter of those received: the same autograd
        # graph on every rank (as TorchRec's dist), so every rank runs the backward
        # all-to-alls of a collection's shardings in the same order.
        send = self._gather(local_embs, sends.reshape(-1), sent_counts, in_splits, batch)
        # TorchRec's own all-to-all: its backward divides the gradients by the world size (as
        # TorchRec's pooled output dist does, `get_gradient_division`).
        recv = AllToAllSingle.apply(
            send, out_splits, in_splits, pg_name(self._pg), world, get_gradient_division()
        )
        self.elements_sent += send.numel()
        self.elements_kept += in_splits[self._rank]
        self.elements_received += recv.numel()
        self.elements_full += local_embs.numel()
        got = gets.reshape(-1)
        return _Later(
            lambda: self._scatter(recv, got, got_counts, out_splits, batch), self._callbacks
        )

    def _gather(self, embs, bags, counts, splits, batch):  # noqa: ANN001, ANN202
        """The outputs of the set `bags` (peer, feature, sample) of `embs` `[W * B, dims]`,
        flat, in that order."""
        dims = self._dims[self._rank]
        if len(set(dims)) == 1:  # one width: whole rows of `embs` seen as [W * B * F, dim]
            rows = self._rows(bags, sum(counts), len(dims), batch)
            return embs.reshape(-1, dims[0]).index_select(0, rows).reshape(-1)
        at = self._elements(bags, sum(counts), sum(splits), dims, embs.shape[1], batch)
        return embs.reshape(-1).index_select(0, at)

    def _scatter(self, recv, bags, counts, splits, batch):  # noqa: ANN001, ANN202
        """`[B, every peer's dims]`: the outputs received (flat, the set `bags` (peer's
        feature, sample) in order) in place, zeros elsewhere."""
        dims = [d for per_rank in self._dims for d in per_rank]
        if len(set(dims)) == 1:
            rows = self._rows(bags, sum(counts), len(dims), batch)
            return _Scatter.apply(recv.view(-1, dims[0]), rows, batch, sum(dims))
        at = self._elements(bags, sum(counts), sum(splits), dims, sum(dims), batch)
        return _Scatter.apply(recv.view(-1, 1), at, batch, sum(dims))

    def _order(self, keys: list[str], device: torch.device) -> torch.Tensor:
        """Where each peer's features (in the peers' column order) sit among the batch's
        `keys`: the same every batch, built once per key order."""
        order = self._orders.get(tuple(keys))
        if order is None:
            index = {k: i for i, k in enumerate(keys)}
            at = [index[f] for features in self._features for f in features]
            order = self._orders[tuple(keys)] = torch.tensor(at, dtype=torch.long, device=device)
        return order

    @staticmethod
    def _rows(bags: torch.Tensor, entries: int, features: int, batch: int) -> torch.Tensor:
        """As `_elements` for one width: the row `(p * batch + b) * F + f` of each bag set."""
        row, feature = _bag_rows(bags, entries, features, batch)
        return row * features + feature

    def _elements(
        self, bags: torch.Tensor, entries: int, total: int, dims: list[int], width: int, batch: int
    ) -> torch.Tensor:
        """Flat positions `[total]` of the output elements of the bags set in `bags` (bool
        `[blocks * F * batch]`: block p, feature f, sample b, with F = len(dims); `entries` of
        them set), in that order, each bag's dims[f] columns in turn, in a layout of rows
        `p * batch + b` of `width` columns where feature f starts at column sum(dims[:f]):
        `local_embs` (one block per peer) and the output (one block: every peer's features)."""
        device = bags.device
        dim = self._ints(dims, device)
        first = torch.cumsum(dim, 0) - dim  # [F] each feature's first column
        row, feature = _bag_rows(bags, entries, len(dims), batch)  # [entries] each
        length = dim.index_select(0, feature)  # [entries] columns of each bag
        base = row * width + first.index_select(0, feature)
        start = torch.cumsum(length, 0) - length  # each bag's first element in the result
        column = torch.arange(total, device=device) - torch.repeat_interleave(
            start, length, output_size=total
        )
        return torch.repeat_interleave(base, length, output_size=total) + column


def _bag_rows(
    bags: torch.Tensor, entries: int, features: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the `entries` bags set in `bags` (bool `[blocks * features * batch]`: block
    p, feature f, sample b), in order: its row `p * batch + b` and its feature f."""
    k = torch.nonzero_static(bags, size=entries).squeeze(1)
    bag, sample = k // batch, k % batch
    return (bag // features) * batch + sample, bag % features


def _volumes(counts: list[int], dims_per_block: list[list[int]]) -> list[int]:
    """Elements per block: the bags counted per (block, feature), `counts` in that order,
    times each feature's width."""
    volumes, k = [], 0
    for dims in dims_per_block:
        volumes.append(sum(c * d for c, d in zip(counts[k : k + len(dims)], dims, strict=True)))
        k += len(dims)
    return volumes
