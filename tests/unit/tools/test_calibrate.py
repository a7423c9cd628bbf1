"""`python -m distcache calibrate`: the quick run end to end, and each measurement's sanity."""

import contextlib
import functools
import json
import re
from pathlib import Path

import pytest
import torch

import distcache.tools.calibrate as calibrate_module
import distcache.tools.compute_figures as compute_figures
from distcache.errors import DistcacheConfigError
from distcache.job.distributed import run_ranks
from distcache.planner.topology import HBM_RESERVE_FRACTION, preset
from distcache.planner.types import Topology
from distcache.tools.calibrate import (
    CUDA_QUICK,
    QUICK,
    LinkFit,
    LookupCosts,
    Measurements,
    ScheduleCosts,
    StagingCosts,
    fit_latency_bandwidth,
    main,
    measure_activation_bandwidth,
    measure_collectives,
    measure_copy_bandwidth,
    measure_dense_flops,
    measure_dense_layer_overhead,
    measure_interaction_costs,
    measure_lookup_costs,
    measure_staging_costs,
    measure_sync_latency,
    topology_from,
)
from distcache.tools.densebench import (
    InteractionCosts,
    dot_interaction,
    fit_interaction_costs,
    sparse_vectors,
)
from distcache.tools.framework_costs import FrameworkCosts
from distcache.tools.uvmbench import UVMCacheCosts, fit_uvm_costs


def test_quick_run_writes_a_valid_topology(tmp_path, capsys):
    """One rank runs in this process (fast); `test_network_figures_on_two_ranks` spawns two."""
    out = tmp_path / "topology.json"
    assert main(["--quick", "--ranks", "1", "--threads", "1", "--out", str(out)]) == 0
    topology = Topology.from_dict(json.loads(out.read_text()))
    assert topology.world_size == topology.ranks_per_node == 1
    assert topology.compute_device == "cpu"
    # Zero allowed: host overheads a machine may not show, the interaction's cost per pair
    # (its fit keeps it >= 0), the row-wise outputs' extra latency (no network on one rank).
    zero_allowed = ["interaction_s_per_pair", "row_wise_output_latency_s"]
    # The scheduler's per-slot (or per-id) cost, where its fit gives the other all the time
    # (a victim's cost no longer grows with the cache): 0, and the calibration says so.
    for name, cost in (("schedule_s_per_candidate", "per-slot"), ("schedule_s_per_id", "per-id")):
        if f"the scheduler's {cost} cost lost in the noise: 0" in topology.calibration:
            zero_allowed.append(name)
    for name, value in topology.to_dict().items():
        if isinstance(value, float | int) and not isinstance(value, bool):
            may_be_zero = name.endswith("overhead_s") or name in zero_allowed
            assert value > 0 or may_be_zero and value == 0, name
    # The CPU-only figures are measured (their GPU defaults are None / 0).
    assert topology.lookup_rows_per_s and topology.dense_update_bytes_per_s
    assert topology.device_lookup_rows_per_s  # TorchRec's fused kernel, measured too
    assert topology.dense_layer_overhead_s > 0 and topology.step_overhead_s > 0
    assert topology.interaction_s_per_element and topology.interaction_s_per_pair >= 0
    # The stager's rate covers both ways on CPU; the machine and date are named.
    assert topology.device_to_host_bw_bytes_per_s is None
    assert topology.calibration.startswith("calibrated cpu x1 on ")
    printed = capsys.readouterr().err
    assert "embedding lookup" in printed and "per sharding type" in printed
    assert "cache scheduler" in printed
    assert "not measured (one rank)" in printed  # the CPU preset's network figures stand in
    # No host link on CPU: the figure is the stager's, and says so (it is far below a copy's).
    assert "of rows staged: distcache's stager with its bookkeeping" in printed


def _network_rank(rank: int, world: int, out: str) -> None:
    fits = measure_collectives((1024, 64 * 1024))
    sync = measure_sync_latency(burst_s=5e-4, collectives=2, repeats=3)
    if rank == 0:
        figures = {k: [f.latency_s, f.bw_bytes_per_s] for k, f in fits.items()}
        Path(out, "net.json").write_text(json.dumps(figures | {"sync": sync}))


def test_network_figures_on_two_ranks(tmp_path):
    run_ranks(_network_rank, 2, args=(str(tmp_path),), timeout_s=120)
    net = json.loads((tmp_path / "net.json").read_text())
    for name in ("all_to_all", "all_reduce", "reduce_scatter", "all_gather"):
        latency, bandwidth = net[name]
        assert latency > 0 and bandwidth > 0, name
    assert net["sync"] >= 0


def test_row_wise_outputs_priced_against_the_all_to_all():
    """The topology prices a row-wise output's byte (reduce-scatter forward, all-gather
    backward) against the link's all-to-all rate, and its latency beyond two sync latencies."""
    links = {
        "all_to_all": LinkFit(latency_s=1e-4, bw_bytes_per_s=2e9),
        "all_reduce": LinkFit(latency_s=2e-4, bw_bytes_per_s=4e9),  # the link: 2e9, 2e-4 s
        "reduce_scatter": LinkFit(latency_s=3e-3, bw_bytes_per_s=5e8),
        "all_gather": LinkFit(latency_s=1e-3, bw_bytes_per_s=1e9),
    }
    measured = Measurements(
        device="cpu", ranks=2, threads_per_rank=1, copy_bw_bytes_per_s=1e10,
        host_to_device_bw_bytes_per_s=1e9, host_to_device_latency_s=1e-6,
        lookup_rows_per_s=1e7, lookup_bytes_per_s=None, dense_flops_per_s=1e11,
        dense_layer_overhead_s=5e-5, dense_activation_bytes_per_s=1e10,
        device_memory_bytes=1 << 30, host_memory_bytes=1 << 30, **links,
    )  # fmt: skip
    topology = topology_from(measured, name="t")
    assert topology.intra_node_bw_bytes_per_s == 2e9 and topology.network_latency_s == 2e-4
    # A byte: 1/5e8 + 1/1e9 s through both, against 2/2e9 s for two all-to-alls.
    assert topology.row_wise_output_slowdown == pytest.approx((1 / 5e8 + 1 / 1e9) / (2 / 2e9))
    assert topology.row_wise_output_latency_s == pytest.approx(3e-3 + 1e-3 - 2 * 2e-4)


def test_copy_bandwidth_in_sane_range():
    assert 1e8 <= measure_copy_bandwidth(nbytes=QUICK.copy_bytes, repeats=3) <= 1e12


def test_compute_rates_positive():
    for kernel in ("distcache", "fused"):  # ours, and TorchRec's (FBGEMM's) for device tables
        lookup = measure_lookup_costs(
            rows=5_000, dims=(8, 32), bags=(32, 128), pooling=4, repeats=2, kernel=kernel
        )
        assert 1e4 < lookup.rows_per_s < 1e11 and lookup.fixed_s >= 0, kernel
        assert lookup.bytes_per_s is None or lookup.bytes_per_s > 0, kernel
    with pytest.raises(DistcacheConfigError, match="kernel must be"):
        measure_lookup_costs(rows=10, dims=(8, 16), bags=(2, 4), kernel="uvm")
    staging = measure_staging_costs(rows=5_000, dim=8, bags=64, capacities=(0.4, 0.8), repeats=2)
    assert staging.bytes_per_s is None or staging.bytes_per_s > 0
    assert staging.scan_rows_per_s is None or staging.scan_rows_per_s > 0
    flops = measure_dense_flops(batch=64, widths=(32, 64, 16), repeats=2)
    assert 1e6 < flops < 1e15
    layer = measure_dense_layer_overhead(layers=4, repeats=3)
    assert 0 < layer < 0.1
    activations = measure_activation_bandwidth(
        batch=256, widths=(8, 64, 8), flops_per_s=flops, layer_overhead_s=0.0, repeats=2
    )
    assert activations is None or activations > 0
    interaction = measure_interaction_costs(batch=64, shapes=((3, 8), (5, 16)), repeats=2)
    assert 0 < interaction.s_per_element < 1e-3 and interaction.s_per_pair >= 0


def test_timed_interaction_is_torchrecs():
    """The interaction `calibrate` times computes what TorchRec's DLRM does: its input built
    from the pooled output as `SparseArch` builds it, the products as `InteractionArch`."""
    from torchrec.models.dlrm import InteractionArch
    from torchrec.sparse.jagged_tensor import KeyedTensor

    dense, pooled = torch.randn(6, 4), torch.randn(6, 12)
    kt = KeyedTensor(keys=["a", "b", "c"], length_per_key=[4, 4, 4], values=pooled)
    per_feature = kt.to_dict()
    sparse = torch.cat([per_feature[k] for k in "abc"], dim=1).reshape(-1, 3, 4)
    assert torch.equal(sparse_vectors(pooled, 3, 4), sparse)
    expected = InteractionArch(num_sparse_features=3)(dense, sparse)
    assert torch.equal(dot_interaction(dense, sparse), expected)


def test_interaction_fit_recovers_its_costs():
    shapes = [(5, 16), (9, 128), (17, 32), (27, 16)]
    exact = [1024 * (f * d * 7e-9 + f * f * 3e-9) for f, d in shapes]
    fit = fit_interaction_costs(shapes, 1024, exact)
    assert fit.s_per_element == pytest.approx(7e-9) and fit.s_per_pair == pytest.approx(3e-9)
    # Products that cost nothing of their own (noise would give a negative b): elements alone.
    flat = fit_interaction_costs([(3, 8), (9, 8)], 10, [10 * 3 * 8 * 1e-8, 10 * 9 * 8 * 0.9e-8])
    assert flat.s_per_pair == 0 and 0.9e-8 < flat.s_per_element < 1e-8
    with pytest.raises(DistcacheConfigError, match="need >= 2"):
        fit_interaction_costs([(3, 8)], 10, [1e-3])


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    fit = fit_latency_bandwidth(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bw_bytes_per_s == pytest.approx(2e9, rel=1e-6)


def test_fit_stays_positive_on_noise():
    fit = fit_latency_bandwidth([1e3, 1e6], [2e-3, 1e-3])  # larger message faster: noise
    assert fit.latency_s > 0 and fit.bw_bytes_per_s > 0


def test_bad_arguments_fail_cleanly(capsys):
    assert main(["--quick", "--ranks", "0"]) == 2
    assert "ranks must be >= 1" in capsys.readouterr().err
    assert main(["--quick", "--ranks", "1", "--timeout", "-5"]) == 2
    assert "timeout must be > 0 seconds, got -5.0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # refused before measuring, not after
        main(["--quick", "--ranks", "1", "--out", "no/such/folder/t.json"])
    assert "--out: the folder 'no/such/folder' of" in capsys.readouterr().err


def test_a_measurement_that_cannot_be_written_is_printed(tmp_path, capsys, monkeypatch):
    out = tmp_path / "topology.json"
    real = Path.write_text

    def full_disk(path, *args, **kwargs):
        if path == out:
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert main(["--quick", "--ranks", "1", "--threads", "1", "--out", str(out)]) == 1
    printed, err = capsys.readouterr()
    assert Topology.from_dict(json.loads(printed)).world_size == 1
    assert f"cannot write --out {out} ([Errno 28] No space left on device)" in err
    with pytest.raises(DistcacheConfigError, match="mlp_widths"):
        type(QUICK)(mlp_widths=(8,))


# The `Topology` figures the cost model reads on a GPU, each measured by a CUDA calibration
# (calibrate's module docstring lists how); the network ones are measured between ranks.
CUDA_MEASURED = (
    "device_memory_bytes", "host_memory_bytes", "device_memory_bw_bytes_per_s",
    "host_to_device_bw_bytes_per_s", "device_to_host_bw_bytes_per_s", "host_to_device_latency_s",
    "lookup_rows_per_s", "lookup_bytes_per_s", "device_lookup_rows_per_s",
    "device_lookup_bytes_per_s", "cache_scan_rows_per_s", "schedule_s_per_id",
    "schedule_s_per_candidate", "reactive_cache_s_per_id", "reactive_cache_s_per_miss",
    "dense_flops_per_s",
    "dense_layer_overhead_s",
    "dense_activation_bytes_per_s", "interaction_s_per_element", "interaction_s_per_pair",
    "step_overhead_s", "sharding_overhead_s", "id_overhead_s", "hot_bag_overhead_s",
    "dense_update_bytes_per_s",
)  # fmt: skip
NETWORK = (
    "intra_node_bw_bytes_per_s", "inter_node_bw_bytes_per_s", "network_latency_s",
    "row_wise_output_slowdown", "row_wise_output_latency_s", "sync_latency_s",
)  # fmt: skip
FROM_ARGUMENTS = ("name", "world_size", "ranks_per_node", "num_nodes", "compute_device")


def test_the_list_covers_every_figure_the_cost_model_reads():
    """A figure the planner reads is measured on CUDA, measured between ranks, or set by the
    arguments (a new `Topology` figure must join one of them)."""
    planner = Path(__file__).parents[3] / "distcache" / "planner"
    read = {
        name
        for path in planner.glob("*.py")
        for name in re.findall(r"\btopology\.(\w+)", path.read_text())
    }
    read -= {"to_dict"}
    assert read - set(CUDA_MEASURED + NETWORK + FROM_ARGUMENTS) == set()


class _Stubs:
    """Every measurement `calibrate` makes (`compute_figures`' and the framework's), replaced
    by one that records its device and returns a value no preset has."""

    def __init__(self, monkeypatch, *, framework_missing: str | None = None):
        self.devices: list[tuple[str, str | None]] = []
        self.backends: list[str] = []
        patch = functools.partial(monkeypatch.setattr, compute_figures)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (40e9, 80e9))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
        ours = self._record("lookup", LookupCosts(rows_per_s=1.1e9, bytes_per_s=1.2e11, fixed_s=0))
        fused = self._record("fused", LookupCosts(rows_per_s=1.3e9, bytes_per_s=1.4e11, fixed_s=0))
        patch("measure_copy_bandwidth", self._record("copy", 1.5e12))
        patch(
            "measure_lookup_costs",
            lambda kernel, **kw: (fused if kernel == "fused" else ours)(**kw),
        )
        patch("measure_dense_flops", self._record("flops", 2.1e14))
        interaction = InteractionCosts(s_per_element=2.2e-12, s_per_pair=2.3e-13)
        patch("measure_interaction_costs", self._record("interaction", interaction))
        patch("measure_copy_latency", self._record("latency", 3.1e-6))
        staging = StagingCosts(bytes_per_s=3.2e10, scan_rows_per_s=3.3e11)
        patch("measure_staging_costs", self._record("staging", staging))
        patch("measure_host_to_device_bandwidth", self._record("h2d", 5.1e10, device="cuda"))
        patch("measure_device_to_host_bandwidth", self._record("d2h", 4.9e10, device="cuda"))
        schedule = ScheduleCosts(fixed_s=1e-4, s_per_id=3.4e-9, s_per_candidate=3.5e-10)
        patch("measure_schedule_costs", self._record("schedule", schedule))
        uvm = UVMCacheCosts(s_per_id=3.6e-9, s_per_miss=3.7e-8)
        patch("measure_uvm_cache_costs", self._record("uvm", uvm, device="cuda"))
        patch("measure_dense_layer_overhead", self._record("layer", 4.1e-5))
        patch("measure_activation_bandwidth", self._record("activations", 4.2e12))
        framework = FrameworkCosts(
            step_overhead_s=5.1e-3, sharding_overhead_s=5.2e-4, id_overhead_s=5.3e-8,
            hot_bag_overhead_s=5.4e-8, dense_update_bytes_per_s=5.5e11,
        )  # fmt: skip
        on_calibrate = functools.partial(monkeypatch.setattr, calibrate_module)
        on_calibrate("measure_framework_costs", self._record("framework", framework))
        on_calibrate("cuda_missing", lambda: framework_missing)

        @contextlib.contextmanager
        def group(backend):
            self.backends.append(backend)
            yield

        on_calibrate("single_rank_group", group)

    def _record(self, name, value, device=None):
        def measure(*args, **kw):
            self.devices.append((name, kw.get("device", device)))
            return value

        return measure


def test_a_cuda_calibration_measures_every_figure(monkeypatch):
    """On CUDA every figure of the GPU model comes from a measurement on the GPU (no preset
    default survives), the framework's costs under a one-rank NCCL group; the topology names
    the machine and the date."""
    stubs = _Stubs(monkeypatch)
    m = calibrate_module.calibrate(ranks=1, device="cuda", sizes=CUDA_QUICK)
    topology = topology_from(m, name="gpu")
    assert {device for _, device in stubs.devices} == {"cuda"}
    assert stubs.backends == ["nccl"]
    expected = {
        "device_memory_bytes": int(40e9 * (1 - HBM_RESERVE_FRACTION)),
        "device_memory_bw_bytes_per_s": 2 * 1.5e12,
        "host_to_device_bw_bytes_per_s": 5.1e10, "device_to_host_bw_bytes_per_s": 4.9e10,
        "host_to_device_latency_s": 3.1e-6, "lookup_rows_per_s": 1.1e9,
        "lookup_bytes_per_s": 1.2e11, "device_lookup_rows_per_s": 1.3e9,
        "device_lookup_bytes_per_s": 1.4e11, "cache_scan_rows_per_s": 3.3e11,
        "schedule_s_per_id": 3.4e-9, "schedule_s_per_candidate": 3.5e-10,
        "reactive_cache_s_per_id": 3.6e-9, "reactive_cache_s_per_miss": 3.7e-8,
        "dense_flops_per_s": 2.1e14,
        "dense_layer_overhead_s": 4.1e-5,
        "dense_activation_bytes_per_s": 4.2e12, "interaction_s_per_element": 2.2e-12,
        "interaction_s_per_pair": 2.3e-13, "step_overhead_s": 5.1e-3,
        "sharding_overhead_s": 5.2e-4, "id_overhead_s": 5.3e-8, "hot_bag_overhead_s": 5.4e-8,
        "dense_update_bytes_per_s": 5.5e11,
    }  # fmt: skip
    assert set(expected) == set(CUDA_MEASURED) - {"host_memory_bytes"}
    assert {name: getattr(topology, name) for name in expected} == expected
    assert topology.host_memory_bytes > 0 and topology.compute_device == "cuda"
    gpu = preset("h100", world_size=1)  # one rank: no network to measure
    assert topology.intra_node_bw_bytes_per_s == gpu.intra_node_bw_bytes_per_s
    assert m.staging_bytes_per_s == 3.2e10  # reported, not priced on CUDA
    assert "calibrated cuda x1 on" in topology.calibration
    assert "Fake GPU" in topology.calibration and " UTC" in topology.calibration
    assert Topology.from_dict(json.loads(json.dumps(topology.to_dict()))) == topology


def test_a_cuda_calibration_says_what_it_could_not_measure(monkeypatch, capsys):
    """Without TorchRec on CUDA the framework's costs keep the preset's values, without
    FBGEMM's kernel its TBE is not measured: each one named in the topology and the summary."""
    stubs = _Stubs(monkeypatch, framework_missing="no TorchRec here")
    lookup = compute_figures.measure_lookup_costs

    def without_fbgemm(kernel, **kw):
        if kernel == "fused":
            raise ImportError("No module named 'fbgemm_gpu'")
        return lookup(kernel=kernel, **kw)

    monkeypatch.setattr(compute_figures, "measure_lookup_costs", without_fbgemm)
    monkeypatch.setattr(compute_figures, "measure_activation_bandwidth", lambda **kw: None)
    assert main(["--device", "cuda", "--ranks", "1", "--quick"]) == 0
    printed = capsys.readouterr()
    topology = Topology.from_dict(json.loads(printed.out))
    assert stubs.backends == []
    gpu = preset("h100", world_size=1)
    for name in FrameworkCosts.__dataclass_fields__:
        assert getattr(topology, name) == getattr(gpu, name), name
    assert topology.device_lookup_rows_per_s is None
    assert topology.reactive_cache_s_per_id is None  # (FBGEMM's UVM cache: not tried)
    assert topology.dense_activation_bytes_per_s is None
    for note in ("framework costs not measured (no TorchRec here)", "FBGEMM's TBE not measured",
                 "activation traffic lost in the noise"):  # fmt: skip
        assert note in topology.calibration and note in printed.err, note


def test_a_cuda_calibration_keeps_its_figures_when_the_framework_step_fails(monkeypatch):
    """The framework's DMP step on a GPU (never run there yet) failing costs only its own
    figures: they keep the preset's values, the topology says why, the rest is measured."""
    _Stubs(monkeypatch)

    def fails(*args, **kw):
        raise RuntimeError("NCCL error: unhandled system error\nmore lines")

    monkeypatch.setattr(calibrate_module, "measure_framework_costs", fails)
    topology = topology_from(
        calibrate_module.calibrate(ranks=1, device="cuda", sizes=CUDA_QUICK), name="gpu"
    )
    gpu = preset("h100", world_size=1)
    for name in FrameworkCosts.__dataclass_fields__:
        assert getattr(topology, name) == getattr(gpu, name), name
    assert topology.lookup_rows_per_s == 1.1e9  # measured
    assert "framework costs failed (RuntimeError: NCCL error: unhandled system error)" in (
        topology.calibration
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on CPU a failure is a bug
    with pytest.raises(RuntimeError, match="NCCL error"):
        calibrate_module.calibrate(ranks=1, device="cpu", sizes=QUICK)


def test_a_cuda_calibration_measures_the_framework_without_data_parallel_where_it_fails(
    monkeypatch,
):
    """An FBGEMM build without the data-parallel (dense) kernel: the framework's costs are
    measured without its two plans, the dense update keeps the preset's value, and the
    topology says so."""
    _Stubs(monkeypatch)
    calls = []

    def measure(*args, data_parallel, **kw):
        calls.append(data_parallel)
        if data_parallel:
            raise RuntimeError("CUDA error: device kernel image is invalid\nmore")
        return FrameworkCosts(
            step_overhead_s=2e-4, sharding_overhead_s=1e-5, id_overhead_s=1e-9,
            hot_bag_overhead_s=0.0, dense_update_bytes_per_s=None,
        )  # fmt: skip

    monkeypatch.setattr(calibrate_module, "measure_framework_costs", measure)
    topology = topology_from(
        calibrate_module.calibrate(ranks=1, device="cuda", sizes=CUDA_QUICK), name="gpu"
    )
    assert calls == [True, False]
    assert (topology.step_overhead_s, topology.sharding_overhead_s) == (2e-4, 1e-5)
    assert (
        topology.dense_update_bytes_per_s == preset("h100", world_size=1).dense_update_bytes_per_s
    )
    assert (
        "the data-parallel plans failed (RuntimeError: CUDA error: device kernel image is "
        "invalid): dense_update_bytes_per_s keeps the preset's value" in topology.calibration
    )


def test_a_cuda_calibration_without_fbgemms_uvm_cache_says_so(monkeypatch):
    """FBGEMM's UVM cache failing on the GPU (a packed build without its kernels) or lost in
    the noise leaves reactive caches priced by their staging, and the topology says which; its
    misses not told from its ids leave it priced per id alone."""
    _Stubs(monkeypatch)
    for measured, note in (
        (RuntimeError("CUDA error: device kernel image is invalid\nmore"),
         "FBGEMM's UVM cache not measured (RuntimeError: CUDA error: device kernel image is "
         "invalid): reactive caches priced by staging"),
        (UVMCacheCosts(None, None),
         "FBGEMM's UVM cache's cost lost in the noise: reactive caches priced by staging"),
        (UVMCacheCosts(3.6e-9, None),
         "FBGEMM's UVM cache's misses not told from its ids: priced per id alone"),
    ):  # fmt: skip

        def uvm(*args, measured=measured, **kw):
            if isinstance(measured, Exception):
                raise measured
            return measured

        monkeypatch.setattr(compute_figures, "measure_uvm_cache_costs", uvm)
        m = calibrate_module.calibrate(ranks=1, device="cuda", sizes=CUDA_QUICK)
        topology = topology_from(m, name="gpu")
        assert topology.reactive_cache_s_per_id == getattr(measured, "s_per_id", None)
        assert topology.reactive_cache_s_per_miss is None
        assert note in topology.calibration
        assert topology.device_lookup_rows_per_s == 1.3e9  # the rest measured


def test_fbgemms_uvm_cache_is_fitted_per_id_and_per_miss():
    """`fit_uvm_costs` recovers a cache's cost per id and per miss from three steps (two batch
    sizes, then two cache sizes), its fixed part cancelled; where the cache sizes do not tell
    the misses apart (noise) it falls back to the slope per id, misses included."""
    ids, misses = (8192, 65536), (3000.0, 20000.0, 8000.0)

    def extra(i, m, per_miss=3e-7):
        return 1e-4 + 2e-9 * i + per_miss * m

    steps = [extra(ids[0], misses[0]), extra(*(ids[1], misses[1])), extra(ids[1], misses[2])]
    fit = fit_uvm_costs(ids, misses, steps)
    assert fit.s_per_id == pytest.approx(2e-9) and fit.s_per_miss == pytest.approx(3e-7)
    noisy = [*steps[:2], steps[1] + 1e-5]  # the smaller cache's step no slower: no per-miss
    slope = (steps[1] - steps[0]) / (ids[1] - ids[0])
    assert fit_uvm_costs(ids, misses, noisy) == UVMCacheCosts(pytest.approx(slope), None)
    assert fit_uvm_costs(ids, misses, [steps[1], steps[0], steps[2]]) == UVMCacheCosts(None, None)
