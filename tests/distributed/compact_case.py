"""Rank bodies for `test_compact_dist.py`: distcache's compact output dist against TorchRec's
`PooledEmbeddingsAllToAll` on the same pooled outputs (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

from distcache.sharding.compact_dist import CompactPooledEmbeddingDist
from distcache.tools.collectives import CollectiveBytes


def compact_equals_torchrec(
    rank: int, world: int, batch: int, empty: float, seed: int, width: int | None = None
) -> dict:
    """Every rank sends its features' pooled outputs (a feature of 1-3 columns, or `width`
    for all, 0-2 features a rank) for every rank's `batch` samples; a share `empty` of the bags
    has no id (TorchRec pools them to zero). Forward bitwise equal to TorchRec's dist; backward
    too on the bags that have ids (an empty bag's gradient reaches no row)."""
    gen = torch.Generator().manual_seed(seed)  # the same draws on every rank
    features = [[f"f{r}_{i}" for i in range(int(torch.randint(0, 3, (1,), generator=gen)))]
                for r in range(world)]  # fmt: skip
    dims = [[int(torch.randint(1, 4, (1,), generator=gen)) for _ in fs] for fs in features]
    if width is not None:  # one width: the dist moves whole rows
        dims = [[width for _ in fs] for fs in features]
    keys = [f for fs in features for f in fs]
    # lengths[k, s, b]: ids of feature k in sample b of rank s
    lengths = torch.randint(1, 4, (len(keys), world, batch), generator=gen)
    lengths *= torch.rand(len(keys), world, batch, generator=gen) >= empty
    mine = [keys.index(f) for f in features[rank]]
    width = sum(dims[rank])
    torch.manual_seed(seed + 1 + rank)
    embs = torch.randint(-8, 8, (world * batch, width)).float()
    empty_rows = torch.cat(
        [
            (lengths[k] == 0).reshape(-1, 1).expand(-1, d)
            for k, d in zip(mine, dims[rank], strict=True)
        ]
        or [torch.zeros(world * batch, 0, dtype=torch.bool)],
        dim=1,
    )
    embs = torch.where(empty_rows, 0.0, embs)  # TorchRec's lookup pools an empty bag to zero
    weight = torch.randint(-4, 4, (batch, sum(map(sum, dims)))).float()

    group = dist.new_group(backend="gloo")
    compact = CompactPooledEmbeddingDist(group, features, dims, fallback=None)
    mine_lengths = lengths[mine].reshape(-1)  # [F_r * W * B]: feature, then peer, then sample
    cold = lengths[:, rank, :].reshape(-1)  # this rank's samples, every feature
    ours_in = embs.clone().requires_grad_()
    compact.prepare(mine_lengths, keys, cold)
    with CollectiveBytes() as counted:  # what `compare --measure` reports
        ours = compact(ours_in).wait()
        (ours * weight).sum().backward()
    # Forward: what it sent but its own split; backward: the gradients of what it received.
    elements = compact.elements_sent + compact.elements_received - 2 * compact.elements_kept
    assert counted.all_to_all == 4 * elements, (counted.all_to_all, elements)

    reference = PooledEmbeddingsAllToAll(dist.group.WORLD, [sum(d) for d in dims])
    theirs_in = embs.clone().requires_grad_()
    theirs = reference(theirs_in, batch_size_per_rank=[batch] * world).wait()
    (theirs * weight).sum().backward()

    assert torch.equal(ours, theirs), (rank, ours, theirs)
    grad_theirs = torch.where(empty_rows, 0.0, theirs_in.grad)
    assert torch.equal(ours_in.grad, grad_theirs), (rank, ours_in.grad, grad_theirs)
    return {"sent": compact.elements_sent, "full": compact.elements_full}
