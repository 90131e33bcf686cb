"""ClusterSpec: presets from data sheets, JSON round trip, validation of malformed files."""

import json

import pytest

from autopar import ClusterSpecError
from autopar.cost_models import PRESETS, ClusterSpec, Link, get_cluster


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_json(name, tmp_path):
    cluster = get_cluster(name)
    path = tmp_path / "c.json"
    cluster.save(path)
    assert ClusterSpec.load(path) == cluster
    assert get_cluster(str(path)) == cluster
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, nothing left behind


def test_presets_match_data_sheets():
    v100 = get_cluster("v100-p3")
    assert (v100.num_hosts, v100.devices_per_host) == (8, 8)
    assert v100.device.flops_for("float16") == 125e12 and v100.device.memory_bytes == 16 * 2**30
    assert v100.inter_host.bandwidth == 25e9 / 8  # 25 Gb/s per host
    a100 = get_cluster("a100-dgx")
    assert a100.device.flops_for("bfloat16") == 312e12 and a100.inter_host.bandwidth == 200e9  # 8 x 200 Gb/s
    assert get_cluster("h100-dgx").device.flops_for("bfloat16") == 989e12


def test_cpu_local_reads_a_calibration_file(tmp_path, monkeypatch):
    calibrated = get_cluster("v100-p3").with_mesh(1, 2)
    path = tmp_path / "cal.json"
    calibrated.save(path)
    monkeypatch.setenv("AUTOPAR_CLUSTER", str(path))
    assert get_cluster("cpu-local") == calibrated
    monkeypatch.setenv("AUTOPAR_CLUSTER", str(tmp_path / "absent.json"))
    assert get_cluster("cpu-local").name == "cpu-local"


def _valid() -> dict:
    return get_cluster("a100-dgx").to_dict()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("device"), "missing object 'device'"),
        (lambda d: d.update(num_hosts=0), "num_hosts must be a positive integer"),
        (lambda d: d.update(devices_per_host="8"), "devices_per_host must be a positive integer"),
        (lambda d: d["inter_host"].update(bandwidth=-1), "inter_host.bandwidth must be a positive, finite number"),
        (lambda d: d["intra_host"].update(latency=float("nan")), "intra_host.latency must be a positive, finite"),
        (lambda d: d["device"].update(memory_bandwidth=float("inf")), "memory_bandwidth must be a positive, finite"),
        (lambda d: d["device"].update(efficiency="0.5"), "device.efficiency must be a positive"),
        (lambda d: d["device"].update(efficency=0.7), "unknown field device.'efficency'"),
        (lambda d: d.update(hosts=2), "unknown field 'hosts'"),
        (lambda d: d["device"]["peak_flops"].pop("float32"), "include float32"),
        (lambda d: d["device"].update(efficiency=2), "efficiency must be in"),
        (lambda d: d.update(schema="autopar.cluster/9"), "unknown schema"),
        (lambda d: d["intra_host"].update(overlap=1.5), "intra_host.overlap must be a non-negative, finite number of at most 1"),
        (lambda d: d["device"].update(op_overhead_s=-1e-6), "device.op_overhead_s must be a non-negative"),
        (lambda d: d.update(cores_per_host=0), "cores_per_host must be a positive integer"),
        (lambda d: d.update(host_link=None, host_memory_bandwidth=1e11), "needs host_link"),
        (lambda d: d.update(num_hosts=2049), "16392 devices; at most 16384"),
        (lambda d: d.update(host_memory_bandwidth=0), "host_memory_bandwidth must be a positive"),
        (lambda d: d.update(host_link={"bandwidth": 0, "latency": 1e-5}, host_memory_bandwidth=1e11),
         "host_link.bandwidth must be a positive"),
    ],
)
def test_malformed_cluster_files_name_the_field(mutate, message, tmp_path):
    data = _valid()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterSpecError, match=message):
        ClusterSpec.load(path)


def test_unreadable_cluster_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ClusterSpecError, match="not valid JSON"):
        ClusterSpec.load(bad)
    with pytest.raises(ClusterSpecError, match="does not exist"):
        ClusterSpec.load(tmp_path / "none.json")
    with pytest.raises(ClusterSpecError, match="unknown cluster 'tpu-pod'"):
        get_cluster("tpu-pod")


def test_with_mesh():
    v100 = get_cluster("v100-p3")
    assert v100.with_mesh(2, 4).num_devices == 8
    with pytest.raises(ClusterSpecError, match="at most 8 devices per host"):
        v100.with_mesh(1, 16)


def test_ranks_beyond_the_devices_share_them():
    local = get_cluster("v100-p3").with_mesh(1, 2)
    shared = local.with_ranks(4)
    assert (shared.devices_per_host, shared.cores_per_host) == (4, 2)
    assert shared.with_ranks(8).cores_per_host == 2 and local.with_ranks(2) is local


def test_calibrated_link_fit_recovers_the_ring_formulas():
    """α and β from the all-reduces; all-gathers and reduce-scatters as measured multiples of the
    ring formula's time (gloo's take 2-3 times it)."""
    from autopar.calibrate import fit_factors, fit_link
    from autopar.cost_models import collective_time

    link = Link(bandwidth=2e9, latency=100e-6, gather_factor=2.0, scatter_factor=3.0)
    sizes = [2**k for k in range(10, 24, 2)]
    # 2, 3 and 4 ranks on 2 cores: the groups beyond the cores take n / 2 as long
    measured = {n: {kind: {"sizes": sizes, "times": [collective_time(kind, b, n, link) * max(1, n / 2) for b in sizes]}
                    for kind in ("all_reduce", "all_gather", "reduce_scatter")} for n in (2, 3, 4)}
    alpha, beta = fit_link(measured, cores=2)
    assert alpha == pytest.approx(100e-6, rel=1e-6) and 1 / beta == pytest.approx(2e9, rel=1e-6)
    factors = fit_factors(measured, 2, alpha, beta)
    assert factors == pytest.approx({"gather_factor": 2.0, "scatter_factor": 3.0}, rel=1e-6)
    assert collective_time("reduce_scatter", 1e6, 2, link) == pytest.approx(3 * collective_time("all_reduce", 1e6, 2, link) / 2)


def test_tensor_axis_waits_separate_from_latency_by_two_batch_sizes():
    """The tensor axis's collectives in place take a latency each, their bytes, and the wait for the
    slowest rank after the computation since the previous one (e_n·jitter·√L): the runs at two
    batch sizes, as many collectives and 4 times the computation, give back both; where the
    latency would come out below the links' own, the links' is kept and the jitter fitted alone;
    with one run, all the time in place is latency."""
    from autopar.calibrate import jitter_fit
    from autopar.cost_models.comm import straggler_wait

    alpha, beta, jitter = 300e-6, 1 / 1e9, 0.03

    def run(compute: float, nbytes: float, collectives: int = 40) -> dict[str, float]:
        ops = {"forward_ops_s": compute / 3, "backward_ops_s": 2 * compute / 3}
        waits = collectives * straggler_wait(compute / collectives, 2, jitter)
        return {**ops, "tp_collectives": collectives, "tp_bytes": nbytes,
                "tp_comm_s": 2 * collectives * alpha + nbytes * beta + waits}  # 2 ranks: a = 2, b = 1

    runtime = {"tp": run(0.05, 4e6), "tp_large": run(0.2, 16e6)}
    assert jitter_fit(runtime, 2, 1.0, 50e-6, beta) == pytest.approx((alpha, jitter), rel=1e-9)
    # the links' α above the fit's: kept, and the waits then all jitter
    kept, fitted = jitter_fit(runtime, 2, 1.0, 400e-6, beta)
    assert kept == 400e-6 and 0 < fitted < jitter
    one = jitter_fit({"tp": runtime["tp"]}, 2, 1.0, 50e-6, beta)
    assert one == pytest.approx((alpha + straggler_wait(0.05 / 40, 2, jitter) / 2, 0.0), rel=1e-9)


def test_one_rank_calibration_prices_copies_at_the_device_memory():
    """One GPU measured alone (`calibrate --nproc 1`): no collective to fit; the spec's link is the
    device's own memory, and the planner prices a one-device plan on it."""
    from autopar.calibrate import cluster_spec
    from autopar.models import load_workload
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search

    device = {"matmul_flops": {"float32": 5e13, "bfloat16": 7.8e14}, "conv2d_flops": {}, "memory_bandwidth": 4e12,
              "op_overhead_s": 12e-6, "matmul_half_flops": 6e8, "optimizer_tensor_s": 13e-6, "optimizer_bytes": 28.0}
    runtime = {"per_op_s": 20e-6, "tp_collectives": 0}
    spec = cluster_spec({"device": device, "links": {}, "overlap": {"overlap": 1.0},
                         "runtime": {"dp": runtime, "tp": runtime}}, 1, name="gpu-local")
    assert spec.devices_per_host == 1 and spec.intra_host.bandwidth == pytest.approx(4e12)
    assert spec.intra_host.latency == pytest.approx(12e-6) and spec.device.op_overhead_s == pytest.approx(20e-6)
    w = load_workload("gpt-tiny", device="meta")
    plan = manual_plan(manual_search(Search.start(w, spec, (1, 1))), Layout(1, 1, 1, 1, False))
    assert plan.estimate.step_time_s > 0
