"""`Checkpointer` in one process (no process group): pruning with `keep_last`; checksums
verified on restore, with a fall back to the newest earlier checkpoint that verifies; one clear
error naming the path for a corrupt `latest.json` or when no checkpoint verifies. The multi-rank
resume (bitwise equal to an uninterrupted run) is in tests/distributed/test_checkpoint.py."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags, CheckpointError, TableSpec
from distcache.job.checkpoint import LATEST, MANIFEST, RNG, Checkpointer, _tensor_name


def _saved(
    tmp_path: Path, steps: list[int], keep_last: int
) -> tuple[Checkpointer, torch.nn.Linear]:
    model = torch.nn.Linear(3, 2)
    checkpoints = Checkpointer(tmp_path, every=1, keep_last=keep_last)
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        checkpoints.save(step, model)
    return checkpoints, model


def test_keep_last_deletes_all_but_the_newest(tmp_path: Path) -> None:
    checkpoints, _ = _saved(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert checkpoints.latest() == 5
    restored = torch.nn.Linear(3, 2)
    assert checkpoints.restore(restored) == 5
    assert torch.equal(restored.weight, torch.full((2, 3), 5.0))


def test_keep_last_zero_keeps_every_checkpoint(tmp_path: Path) -> None:
    _saved(tmp_path, [1, 2, 3], keep_last=0)
    assert len(list(tmp_path.glob("step_*"))) == 3


@pytest.mark.parametrize("text", ["{not json", '{"path": "step_00000001"}', '{"step": -1}'])
def test_a_corrupt_latest_json_is_named(tmp_path: Path, text: str) -> None:
    checkpoints, model = _saved(tmp_path, [1], keep_last=0)
    (tmp_path / LATEST).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{tmp_path / LATEST} is corrupt"):
        checkpoints.restore(model)


def _distcp(directory: Path) -> Path:
    (data,) = directory.glob("*.distcp")
    return data


def _scribble(path: Path) -> None:
    """Overwrite 64 bytes in the middle of `path` (same size), as a bad disk or copy would."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = bytes(255 - b for b in raw[middle : middle + 64])
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / ".metadata").unlink(), r"\.metadata is missing"),
        (lambda d: _scribble(_distcp(d)), r"\.distcp does not match its SHA-256"),
        (lambda d: _truncate(_distcp(d)), r"\.distcp has \d+ bytes, \d+ were written"),
        (lambda d: _distcp(d).unlink(), r"\.distcp is missing"),
        (lambda d: (d / MANIFEST).write_text("{"), r"checksums\.json is corrupt"),
    ],
    ids=["metadata-missing", "scribbled", "truncated", "data-missing", "manifest-corrupt"],
)
def test_a_damaged_checkpoint_is_named_and_the_previous_one_loads(
    tmp_path: Path, damage, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints, model = _saved(tmp_path, [1, 2], keep_last=0)
    damage(tmp_path / "step_00000002")
    with caplog.at_level("WARNING", logger="distcache.job.checkpoint"):
        assert checkpoints.restore(model) == 1
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))  # step 1's weights
    (failed,) = [r.getMessage() for r in caplog.records if "failed verification" in r.message]
    assert failed.startswith("the checkpoint of step 2 failed verification: ")
    assert "step_00000002" in failed and re.search(reason, failed), failed
    assert "falling back to the checkpoint of step 1" in caplog.text
    assert (tmp_path / "step_00000002.corrupt").is_dir()  # kept, not deleted
    assert checkpoints.latest() == 1
    # Training on writes step 2 again, verified; the set-aside copy is left alone.
    checkpoints.save(2, model)
    assert checkpoints.restore(model) == 2 and (tmp_path / "step_00000002.corrupt").is_dir()


def test_no_checkpoint_that_verifies_is_one_error(tmp_path: Path) -> None:
    checkpoints, model = _saved(tmp_path, [1], keep_last=0)
    _scribble(_distcp(tmp_path / "step_00000001"))
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies \(step 1: .*SHA"):
        checkpoints.restore(model)
    assert torch.equal(model.weight, before)  # nothing loaded


def test_a_checkpoint_without_checksums_loads_unverified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints, model = _saved(tmp_path, [3], keep_last=0)
    (tmp_path / "step_00000003" / MANIFEST).unlink()  # as written before checksums existed
    with caplog.at_level("WARNING", logger="distcache.job.checkpoint"):
        assert checkpoints.restore(model) == 3
    assert f"has no {MANIFEST}" in caplog.text and "loaded unverified" in caplog.text


def test_resume_says_where_it_starts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 2)
    with caplog.at_level("INFO", logger="distcache.job.checkpoint"):
        assert Checkpointer(tmp_path).restore(model) is None
        assert f"no checkpoint in {tmp_path}: starting from step 0" in caplog.text
        checkpoints, _ = _saved(tmp_path, [7], keep_last=0)
        assert checkpoints.restore(model) == 7
    assert "resumed from the checkpoint of step 7" in caplog.text
    assert "resharded" not in caplog.text  # saved and restored by one process
    (tmp_path / LATEST).write_text('{"step": 7, "path": "step_00000007"}')  # no world size
    caplog.clear()
    with caplog.at_level("INFO", logger="distcache.job.checkpoint"):
        assert checkpoints.restore(model) == 7
    assert "resumed from" in caplog.text and "resharded" not in caplog.text


def test_resume_require_refuses_to_start_over(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"--resume=require: no checkpoint in .*latest"):
        Checkpointer(tmp_path / "none").restore(torch.nn.Linear(3, 2), require=True)


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_without_latest_json_resume_takes_the_newest_that_verifies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints, model = _saved(tmp_path, [1, 2, 3], keep_last=0)
    (tmp_path / LATEST).unlink()
    (tmp_path / "step_00000003" / ".metadata").unlink()  # the newest is incomplete
    with caplog.at_level("WARNING", logger="distcache.job.checkpoint"):
        assert checkpoints.restore(model) == 2
    assert f"{LATEST} is missing in {tmp_path} (3 checkpoint(s), steps 1 to 3)" in caplog.text
    assert torch.equal(model.weight, torch.full((2, 3), 2.0))
    assert checkpoints.latest() == 2  # named again
    assert (tmp_path / "step_00000003.corrupt").is_dir()  # kept, set aside


def test_a_fresh_start_never_overwrites_checkpoints(tmp_path: Path) -> None:
    checkpoints, _ = _saved(tmp_path, [10, 20], keep_last=0)
    before = _digests(tmp_path)
    found = r"holds checkpoints \(2 checkpoint\(s\), steps 10 to 20, latest.json\) that this"
    with pytest.raises(CheckpointError, match=found):
        Checkpointer(tmp_path, every=10).guard_fresh_start()
    assert _digests(tmp_path) == before
    (tmp_path / LATEST).unlink()  # checkpoints without a pointer count too
    with pytest.raises(CheckpointError, match=r"--resume=never starts over"):
        Checkpointer(tmp_path, every=10).guard_fresh_start()
    Checkpointer(tmp_path / "empty", every=10).guard_fresh_start()  # nothing there: fine


def test_starting_over_keeps_the_old_checkpoints_aside(tmp_path: Path) -> None:
    for n in range(2):  # a second start-over does not touch the first one's
        _saved(tmp_path, [10, 20], keep_last=0)
        before = {k: v for k, v in _digests(tmp_path).items() if not k.startswith("superseded")}
        Checkpointer(tmp_path, every=10).guard_fresh_start(start_over=True)
        assert Checkpointer(tmp_path).steps_on_disk() == []
        assert _digests(tmp_path / f"superseded.{n}") == before


class _Tables(torch.nn.Module):
    """A TorchRec-like model: a table `t0` of `dim` columns beside a dense layer."""

    def __init__(self, dim: int, out: int = 2):
        super().__init__()
        self.embedding_bags = torch.nn.ModuleDict({"t0": torch.nn.EmbeddingBag(10, dim)})
        self.dense = torch.nn.Linear(dim, out)


def test_resuming_into_another_model_names_the_tables_and_shapes(tmp_path: Path) -> None:
    """One `CheckpointError` line before DCP loads anything (DCP's own error is a traceback
    per rank), the tables first; a model with a tensor the checkpoint lacks is refused too."""
    Checkpointer(tmp_path, every=1).save(1, _Tables(dim=4))
    wider = _Tables(dim=8)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError) as raised:
        Checkpointer(tmp_path).restore(wider)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"the checkpoint {tmp_path / 'step_00000001'} was written by ")
    shapes = message.split("another model: ", 1)[1].split(". Resume with")[0]
    assert shapes == (
        "table 't0' is [10, 4] there, [10, 8] here; dense.weight is [2, 4] there, [2, 8] here"
    )
    assert "--resume=never" in message
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())  # untouched
    grown = _Tables(dim=4)
    grown.extra = torch.nn.Linear(1, 1)
    with pytest.raises(CheckpointError, match=r"extra.weight \[1, 1\] is not in it"):
        Checkpointer(tmp_path).restore(grown)


def test_a_model_of_the_same_shapes_loads(tmp_path: Path) -> None:
    saved = _Tables(dim=4)
    Checkpointer(tmp_path, every=1).save(1, saved)
    restored = _Tables(dim=4)
    assert Checkpointer(tmp_path).restore(restored) == 1
    assert torch.equal(restored.dense.weight, saved.dense.weight)


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("model.model.sparse_arch.embedding_bag_collection.embedding_bags.t3.weight", "table 't3'"),
        (
            "fused_optimizer.state.model.sparse_arch.embedding_bag_collection.embedding_bags."
            "t3.weight.t3.momentum1",
            "the momentum1 of table 't3'",
        ),
        ("model.ec.embeddings.seq.weight", "table 'seq'"),
        (
            "model.model.dense_arch.model._mlp.1._linear.bias",
            "model.dense_arch.model._mlp.1._linear.bias",
        ),
    ],
)
def test_a_state_key_is_named_as_the_model_names_it(key: str, name: str) -> None:
    assert _tensor_name(key) == name


def _trained_half_rows(
    steps: int, cached: CachedEmbeddingBags | None = None, device: str = "cpu"
) -> CachedEmbeddingBags:
    """fp16 rows rounded stochastically (FBGEMM's default on CUDA), trained `steps` times by
    updates below half a gap: where each value lands depends on torch's generator."""
    if cached is None:
        tables = [TableSpec(name="t0", num_embeddings=64, embedding_dim=8, dtype=torch.float16)]
        config = CacheConfig(capacity=64, learning_rate=2.0**-14, stochastic_rounding=True)
        cached = CachedEmbeddingBags(tables, config, device=device)
        cached.load_table_weight("t0", torch.ones(64, 8))
    ids, offsets = torch.arange(64, device=device), torch.arange(65, device=device)
    for _ in range(steps):
        cached(ids, offsets).sum().backward()
    return cached


def resumed_and_whole(directory: Path, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The half rows of a run checkpointed after 6 steps and resumed in another generator
    state (a new process), and of the run going on uninterrupted, 6 steps later each."""
    torch.manual_seed(0)
    whole = _trained_half_rows(6, device=device)
    Checkpointer(directory).save(6, whole)
    whole = _trained_half_rows(6, whole)
    torch.manual_seed(1)  # a new process
    resumed = _trained_half_rows(0, device=device)
    assert Checkpointer(directory).restore(resumed) == 6
    resumed = _trained_half_rows(6, resumed)
    return resumed.table_weight("t0"), whole.table_weight("t0")


def test_a_resumed_run_rounds_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """A checkpoint holds each rank's random generators: resumed in another process (another
    generator state), stochastically rounded half rows land where an uninterrupted run's do,
    bitwise (on a GPU: tests/gpu/test_job_cuda.py)."""
    resumed, whole = resumed_and_whole(tmp_path)
    assert not torch.equal(whole, torch.ones(64, 8, dtype=torch.float16))
    assert torch.equal(resumed, whole)


def test_a_checkpoint_without_random_generators_loads_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints, model = _saved(tmp_path, [2], keep_last=0)
    step = tmp_path / "step_00000002"
    (step / RNG.format(rank=0)).unlink()  # as written before they were saved
    manifest = json.loads((step / MANIFEST).read_text())
    del manifest["files"][RNG.format(rank=0)]
    (step / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level("WARNING", logger="distcache.job.checkpoint"):
        assert checkpoints.restore(model) == 2
    assert "random_rank00000.pt is missing" in caplog.text and "from the seed" in caplog.text


def test_resharded_resume_leaves_the_random_generators_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another world size has other ranks' generators: they continue from this process's
    state (the seed, in a job), and the log says so; the same world size restores them."""
    torch.manual_seed(3)
    checkpoints, model = _saved(tmp_path, [4], keep_last=0)
    saved = torch.get_rng_state()
    (tmp_path / LATEST).write_text('{"step": 4, "path": "step_00000004", "world_size": 2}')
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with caplog.at_level("INFO", logger="distcache.job.checkpoint"):
        assert checkpoints.restore(model) == 4
    assert "resharded from 2 ranks to 1 (the random generators continue from the seed)" in (
        caplog.text
    )
    assert torch.equal(torch.get_rng_state(), before)
    (tmp_path / LATEST).write_text('{"step": 4, "path": "step_00000004", "world_size": 1}')
    assert checkpoints.restore(model) == 4
    assert torch.equal(torch.get_rng_state(), saved)
