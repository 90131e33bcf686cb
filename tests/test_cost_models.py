"""Cost models against values computed by hand."""

import pytest

from autopar.contract import schedules
from autopar.cost_models import (
    Collective,
    DeviceSpec,
    Link,
    axis_link,
    collective_time,
    compute_time,
    fits,
    get_cluster,
    model_state_memory,
    p2p_time,
    training_memory,
)

LINK = Link(bandwidth=100e9, latency=10e-6)  # 100 GB/s, 10 µs
B = 1e9  # 1 GB


def test_collectives_alpha_beta():
    # all-reduce over 4: 2·3·10 µs + 2·3/4·1 GB / 100 GB/s = 60 µs + 15 ms
    assert collective_time("all_reduce", B, 4, LINK) == pytest.approx(60e-6 + 0.015)
    # all-gather / reduce-scatter / all-to-all over 4: 3·10 µs + 3/4·10 ms
    for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        assert collective_time(kind, B, 4, LINK) == pytest.approx(30e-6 + 0.0075)
    assert p2p_time(B, LINK) == pytest.approx(10e-6 + 0.01)
    assert collective_time("all_reduce", B, 1, LINK) == 0.0
    # all-reduce costs exactly a reduce-scatter plus an all-gather
    assert collective_time("all_reduce", B, 8, LINK) == pytest.approx(
        collective_time("reduce_scatter", B, 8, LINK) + collective_time("all_gather", B, 8, LINK))


def test_axis_links_on_alpa_testbed():
    v100 = get_cluster("v100-p3")  # 8 hosts × 8 GPUs
    nvlink, nic = v100.intra_host, v100.inter_host
    # logical (8, 8): axis 1 is the 8 GPUs of a host, axis 0 one GPU per host, 8 groups share each NIC
    assert axis_link(v100, (8, 8), 1) == nvlink
    across = axis_link(v100, (8, 8), 0)
    assert across.bandwidth == pytest.approx(nic.bandwidth / 8) and across.latency == nic.latency
    # one ring over all 64: one group per host crosses each NIC
    assert axis_link(v100, (64,), 0).bandwidth == pytest.approx(nic.bandwidth)
    # (16, 4): axis 0 has 2 members per host, so 4 groups share a NIC
    assert axis_link(v100, (16, 4), 0).bandwidth == pytest.approx(nic.bandwidth / 4)
    # a (1, 8) submesh stays on one host whatever the logical shape
    assert axis_link(v100, (2, 4), 0, submesh=(1, 8)) == nvlink
    # uneven: (2, 6) over 3 hosts × 4 — host 1 holds devices of both groups, which share its NIC
    three = v100.with_mesh(3, 4)
    assert axis_link(three, (2, 6), 1).bandwidth == pytest.approx(nic.bandwidth / 2)
    with pytest.raises(ValueError, match="does not tile"):
        axis_link(v100, (3, 8), 0)


def test_roofline():
    dev = DeviceSpec(name="d", peak_flops={"float32": 10e12, "float16": 100e12},
                     memory_bytes=2**30, memory_bandwidth=1e12, efficiency=0.5)
    assert compute_time(1e12, 0, dev, "float16") == pytest.approx(0.02)  # 1 TFLOP at 50 TFLOP/s
    assert compute_time(1e12, 0, dev, "float32") == pytest.approx(0.2)
    assert compute_time(1e9, 1e11, dev, "float16") == pytest.approx(0.1)  # memory bound: 100 GB at 1 TB/s
    assert compute_time(1e12, 0, dev, "int8") == pytest.approx(0.2)  # unlisted dtype runs at fp32


def test_fixed_costs_per_op():
    import dataclasses

    from autopar.cost_models import fixed_time, optimizer_time

    cpu = DeviceSpec(name="core", peak_flops={"float32": 1e11}, memory_bytes=1, memory_bandwidth=1e10, efficiency=1.0,
                     op_overhead_s=5e-6, sharded_op_overhead_s=40e-6, lowered_op_overhead_s=1e-6,
                     matmul_half_flops=1e6)
    # a matmul of 1 MFLOP forward and 2 backward: 30 µs of FLOPs, 3 × 10 µs short of the peak, 2 dispatches
    assert compute_time(3e6, 0, cpu, ops=2, matmuls=3) == pytest.approx(30e-6 + 30e-6 + 10e-6)
    # a sharded stage as it runs: lowered, not op by op through DTensor
    assert fixed_time(cpu, ops=2, matmuls=3, sharded=True) == pytest.approx(30e-6 + 2 * 6e-6)
    # a GPU issues kernels ahead: the host's time is a floor under each op, not an addition
    gpu = dataclasses.replace(cpu, asynchronous=True)
    assert compute_time(3e9, 0, gpu, ops=2) == pytest.approx(0.03)
    assert compute_time(0, 8, gpu, ops=2) == pytest.approx(10e-6)
    # Adam: bytes per element through memory, ops per tensor (more on DTensors)
    opt = dataclasses.replace(cpu, optimizer_bytes=28.0, optimizer_ops=10.0)
    assert optimizer_time(1e9, 4, opt) == pytest.approx(2.8 + 4 * 10 * 5e-6)
    assert optimizer_time(0, 4, opt, dtensors=4) == pytest.approx(4 * 10 * 45e-6)
    # calibrated: what a step costs more per DTensor parameter, measured (its cached ops cost far
    # less than a graph op's sharding propagation)
    measured = dataclasses.replace(opt, optimizer_dtensor_s=0.5e-3)
    assert optimizer_time(0, 4, measured, dtensors=4) == pytest.approx(4 * 10 * 5e-6 + 4 * 0.5e-3)


def test_model_state_memory():
    gb = 1e9
    # mixed precision Adam: 2 + 2 + 8 + 4 = 16 bytes per parameter
    assert model_state_memory(1e9, 2).total == pytest.approx(16 * gb)
    assert model_state_memory(1e9, 4).total == pytest.approx(16 * gb)  # fp32: 4 + 4 + 8
    assert model_state_memory(1e9, 4, optimizer="sgd").total == pytest.approx(8 * gb)
    assert model_state_memory(1e9, 2, optimizer="sgd").total == pytest.approx(8 * gb)  # 2 + 2 + fp32 master 4
    assert model_state_memory(1e9, 2, shard=4).total == pytest.approx(4 * gb)
    z1 = model_state_memory(1e9, 2, zero_stage=1, dp=4)
    assert (z1.params, z1.grads, z1.optimizer) == pytest.approx((2 * gb, 2 * gb, 3 * gb))
    z3 = model_state_memory(1e9, 2, zero_stage=3, dp=4)
    assert z3.total == pytest.approx(4 * gb)
    with pytest.raises(ValueError, match="unknown optimizer"):
        model_state_memory(1, 2, optimizer="lion")


def test_activation_memory_and_fit():
    assert schedules.in_flight("1f1b", 4, 0, 16) == 4
    assert schedules.in_flight("1f1b", 4, 3, 16) == 1
    assert schedules.in_flight("1f1b", 8, 0, 2) == 2
    assert schedules.in_flight("gpipe", 4, 3, 16) == 16
    mem = training_memory(model_state_memory(1e9, 2), 1e9, 4)
    assert mem.activations == 4e9 and mem.total == pytest.approx(20e9)
    assert fits(mem, 24e9) and not fits(mem, 22e9)  # 10 % reserve: 21.6 GB usable
