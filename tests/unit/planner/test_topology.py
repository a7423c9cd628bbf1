"""Topology presets, byte-size parsing and topology files."""

import json

import pytest

from distcache.errors import DistcacheConfigError
from distcache.planner.topology import (
    HBM_RESERVE_FRACTION,
    PRESETS,
    load_topology,
    parse_bytes,
    preset,
    save_topology,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GB", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1e9", 10**9),
        ("1.5 tb", 1_500_000_000_000),
        ("2KiB", 2048),
        ("100", 100),
        (" 7 B ", 7),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["16 parsecs", "GB", "", "-1GB", "1e999GB", -5, True, 1.5])
def test_parse_bytes_errors_name_the_text_and_the_forms(bad):
    with pytest.raises(DistcacheConfigError, match="512MiB") as info:
        parse_bytes(bad)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)


def test_gpu_presets():
    h100 = preset("h100", world_size=16)
    assert (h100.ranks_per_node, h100.num_nodes, h100.compute_device) == (8, 2, "cuda")
    assert h100.device_memory_bytes == int(80 * 2**30 * (1 - HBM_RESERVE_FRACTION))
    assert h100.intra_node_bw_bytes_per_s > h100.inter_node_bw_bytes_per_s
    h200 = preset("h200", world_size=16)
    assert h200.device_memory_bytes > h100.device_memory_bytes
    assert h200.device_memory_bw_bytes_per_s > h100.device_memory_bw_bytes_per_s
    small = preset("h100", world_size=4, device_memory_bytes="16GB")
    assert (small.ranks_per_node, small.device_memory_bytes) == (4, 16 * 10**9)
    assert preset("h200", world_size=16, ranks_per_node=4).num_nodes == 4


def test_cpu_preset_is_one_node():
    cpu = preset("cpu", world_size=2)
    assert (cpu.compute_device, cpu.ranks_per_node, cpu.num_nodes) == ("cpu", 2, 1)


@pytest.mark.parametrize("name", ["h100", "h200", "cpu"])
def test_intra_node_links_are_no_slower_than_inter_node(name):
    topology = preset(name, world_size=16, ranks_per_node=8)
    assert topology.intra_node_bw_bytes_per_s >= topology.inter_node_bw_bytes_per_s


def test_preset_errors():
    with pytest.raises(DistcacheConfigError, match="allowed.*h100"):
        preset("a100", world_size=8)
    with pytest.raises(DistcacheConfigError, match="world_size"):
        preset("h100", world_size=0)
    with pytest.raises(DistcacheConfigError, match="device_memory_bytes"):
        preset("h100", world_size=8, device_memory_bytes=0)
    assert set(PRESETS) == {"h100", "h200", "cpu"}


def test_save_and_load_round_trip(tmp_path):
    topology = preset("h200", world_size=24, device_memory_bytes="100GB")
    path = tmp_path / "topology.json"
    save_topology(topology, path)
    assert load_topology(path) == topology


def test_load_errors(tmp_path):
    bad_key = tmp_path / "extra.json"
    bad_key.write_text(json.dumps({**preset("cpu", world_size=1).to_dict(), "gpus": 3}))
    with pytest.raises(DistcacheConfigError, match="gpus"):
        load_topology(bad_key)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DistcacheConfigError, match="broken.json"):
        load_topology(broken)
    with pytest.raises(DistcacheConfigError, match="missing.json"):
        load_topology(tmp_path / "missing.json")
