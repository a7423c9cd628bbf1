"""Checkpoints with torch.distributed.checkpoint: rows and optimizer state round-trip bitwise,
across world sizes and sharding types, with dirty rows held in caches at save time."""

import pytest
import torch

from tests.distributed.checkpoint_case import assemble, assert_same, load, save
from tests.distributed.harness import run_ranks


@pytest.mark.timeout(300)
def test_save_table_wise_on_2_ranks_load_on_1_and_row_wise(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save, 2, args=(path,), timeout_s=120)
    on_one = run_ranks(load, 1, args=(path, "table_wise"), timeout_s=120)
    assert_same(saved, on_one)
    row_wise = run_ranks(load, 2, args=(path, "row_wise"), timeout_s=120)
    assert_same(saved, row_wise)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad"])
def test_column_wise_optimizer_state_round_trips(tmp_path, optimizer):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(
        save, 2, args=(path, "column_wise"), kwargs={"optimizer": optimizer}, timeout_s=120
    )
    loaded = run_ranks(
        load, 2, args=(path, "column_wise"), kwargs={"optimizer": optimizer}, timeout_s=120
    )
    assert_same(saved, loaded)


@pytest.mark.timeout(300)
def test_elementwise_state_reshards_table_wise_to_row_wise(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(
        save, 2, args=(path, "table_wise"), kwargs={"optimizer": "adagrad"}, timeout_s=120
    )
    loaded = run_ranks(
        load, 2, args=(path, "row_wise"), kwargs={"optimizer": "adagrad"}, timeout_s=120
    )
    assert_same(saved, loaded)


@pytest.mark.timeout(300)
def test_fp16_tables_round_trip_from_2_ranks_to_1(tmp_path):
    """fp16 tables are saved as fp16 (half the bytes) with fp32 optimizer state, bitwise."""
    path = str(tmp_path / "ckpt")
    half = {"data_type": "FP16"}
    saved = run_ranks(save, 2, args=(path, "row_wise"), kwargs=half, timeout_s=120)
    loaded = run_ranks(load, 1, args=(path, "table_wise"), kwargs=half, timeout_s=120)
    assert_same(saved, loaded)
    dtypes = {key.split("/")[-1]: parts[0][1].dtype for key, parts in saved[0].items() if parts}
    weights = [d for k, d in dtypes.items() if k.endswith("weight")]
    states = [d for k, d in dtypes.items() if "momentum" in k]
    assert weights and set(weights) == {torch.float16}, dtypes
    assert states and set(states) == {torch.float32}, dtypes


@pytest.mark.timeout(300)
def test_weighted_tables_round_trip_from_2_ranks_to_1(tmp_path):
    path = str(tmp_path / "ckpt")
    weighted = {"weighted": True}
    saved = run_ranks(save, 2, args=(path, "row_wise"), kwargs=weighted, timeout_s=120)
    loaded = run_ranks(load, 1, args=(path, "table_wise"), kwargs=weighted, timeout_s=120)
    assert_same(saved, loaded)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("data_type", ["FP32", "FP16"])
def test_embedding_collection_round_trips_from_2_ranks_to_1(tmp_path, data_type):
    """EmbeddingCollection tables (per-id lookups) with dirty rows in their caches: saved on 2
    ranks row-wise, loaded on 1 table-wise (and, fp32, on 2 table-wise), bitwise."""
    path = str(tmp_path / "ckpt")
    ec = {"module": "ec", "data_type": data_type}
    saved = run_ranks(save, 2, args=(path, "row_wise"), kwargs=ec, timeout_s=120)
    on_one = run_ranks(load, 1, args=(path, "table_wise"), kwargs=ec, timeout_s=120)
    assert_same(saved, on_one, tables=3)
    weights = {parts[0][1].dtype for key, parts in saved[0].items() if key.endswith("weight")}
    assert weights == {torch.float16 if data_type == "FP16" else torch.float32}, weights
    if data_type == "FP32":
        on_two = run_ranks(load, 2, args=(path, "table_wise"), kwargs=ec, timeout_s=120)
        assert_same(saved, on_two, tables=3)


@pytest.mark.timeout(300)
def test_embedding_collection_hot_rows_round_trip_with_other_hot_rows(tmp_path):
    """EmbeddingCollection tables with hot rows: what training saved equals the same training
    without them (within rounding), and it loads on 1 rank with none and on 2 with another
    set, bitwise."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save, 2, args=(path, "row_wise"), kwargs={"module": "ec", "hot": "a"},
                      timeout_s=120)  # fmt: skip
    plain = run_ranks(save, 2, args=(str(tmp_path / "plain"), "row_wise"),
                      kwargs={"module": "ec"}, timeout_s=120)  # fmt: skip
    ours, theirs = assemble(saved), assemble(plain)
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)
    on_one = run_ranks(load, 1, args=(path, "table_wise"), kwargs={"module": "ec"}, timeout_s=120)
    assert_same(saved, on_one, tables=3)
    other = run_ranks(load, 2, args=(path, "table_wise"), kwargs={"module": "ec", "hot": "b"},
                      timeout_s=120)  # fmt: skip
    assert_same(saved, other, tables=3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel", ["customized_kernel", "fused"])
def test_hot_rows_round_trip_and_load_with_other_hot_rows(tmp_path, kernel):
    """Hot rows are saved in their tables (a user sees one table): saved on 2 ranks with one
    set of hot rows, loaded on 1 rank with none and on 2 ranks with another set, bitwise,
    rows and row-wise Adagrad state, after a forward pass on the loaded model. On distcache's
    kernel and on TorchRec's (FBGEMM's), whose tables distcache's replica is written into."""
    path = str(tmp_path / "ckpt")
    hot = {"hot": "a", "kernel": kernel}
    saved = run_ranks(save, 2, args=(path, "row_wise"), kwargs=hot, timeout_s=120)
    # The checkpoint holds what training produced, hot rows included: the same training
    # without hot rows saves the same tables (within float rounding: the gradients are summed
    # in another order).
    plain = run_ranks(
        save,
        2,
        args=(str(tmp_path / "plain"), "row_wise"),
        kwargs={"kernel": kernel},
        timeout_s=120,
    )
    ours, theirs = assemble(saved), assemble(plain)
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)
    on_one = run_ranks(load, 1, args=(path, "table_wise"), kwargs={"kernel": kernel}, timeout_s=120)
    assert_same(saved, on_one)
    other = run_ranks(
        load, 2, args=(path, "table_wise"), kwargs={"hot": "b", "kernel": kernel}, timeout_s=120
    )
    assert_same(saved, other)
