"""Gradient compression and delayed averaging on the data axis: the compressors' contracts, the
bytes they hand to collectives, and training on gloo ranks with replicas kept identical."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar import AutoparError
from autopar.contract.compression import DGC_WARMUP_STEPS, carries_momentum, parse, runs_dense
from autopar.cost_models.cluster import Link
from autopar.cost_models.compression import compresses, decide, sent_bytes, sync_time, wire
from autopar.cost_models.presets import nominal_cpu
from autopar.runtime.compression import DGCMemory, ErrorFeedback, _compressor
from autopar.runtime.compressors import (
    QSGD,
    DGCSelect,
    OneBit,
    TernGrad,
    Threshold,
    TopK,
    pack,
    unpack,
)
from tests.distributed import run_ranks
from tests.test_parallelize import _assert_same_training, _single

# every tensor the method can take, compressing from the first step (a tiny model's layers are below
# the size floor, and the sparsifiers warm up and PowerSGD starts dense by default)
METHODS = [m + ",min_size=0" for m in ["fp16", "topk:0.01,warmup=0", "randk:0.05", "dgc:0.99,warmup=0",
                                       "powersgd:2,start=0", "onebit,start=0", "threshold:0.001", "terngrad", "qsgd:16",
                                       "signsgd"]]


def slow_link(directory, world: int) -> str:
    """A cluster file (in `directory`) for these cores joined by 100 Mb/s: where compressing pays
    (the cost model compresses nothing on loopback's gigabytes a second)."""
    path = str(directory / "slow-link.json")
    nominal_cpu(2, 24 * 2**30).with_ranks(world).over_link(Link(bandwidth=12.5e6, latency=5e-5)).save(path)
    return path


@given(st.sampled_from([1, 2]), st.lists(st.integers(0, 3), max_size=70))
@settings(max_examples=50, deadline=None)
def test_bit_packing_round_trips(bits, codes):
    codes = [c % (1 << bits) for c in codes]
    packed = pack(torch.tensor(codes, dtype=torch.int32), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(codes) * bits / 8)
    assert unpack(packed, bits, len(codes)).tolist() == codes


@pytest.mark.parametrize("compressor", [TopK(0.05), DGCSelect(0.9), Threshold(0.5)], ids=["topk", "dgc", "threshold"])
def test_error_feedback_conserves_mass_exactly(compressor):
    """What is sent plus what stays behind is exactly what was to be sent (gradient + old residual)."""
    torch.manual_seed(0)
    memory = ErrorFeedback()
    total_in = torch.zeros(500)
    total_sent = torch.zeros(500)
    for step in range(6):
        grad = torch.randn(500)
        x = memory.compensate("w", grad)
        sent = compressor.decompress(compressor.compress(x, step), x)
        memory.update("w", x, sent)
        assert torch.equal(sent + memory.residual["w"], x)
        total_in += grad
        total_sent += sent
    torch.testing.assert_close(total_sent + memory.residual["w"], total_in)


def test_one_bit_error_feedback_keeps_what_the_signs_lose():
    torch.manual_seed(0)
    memory, c = ErrorFeedback(), OneBit()
    x = memory.compensate("w", torch.randn(16, 8))
    sent = c.decompress(c.compress(x, 0), x)
    memory.update("w", x, sent)
    torch.testing.assert_close(sent + memory.residual["w"], x, rtol=0, atol=1e-6)
    # two reconstruction values per column: the means of its positive and of its negative entries
    for j in range(8):
        col = x[:, j]
        assert sent[col >= 0, j].unique().tolist() == pytest.approx([col[col >= 0].mean().item()])


def _seide(x: torch.Tensor) -> torch.Tensor:
    """1-bit quantisation as Seide et al. 2014 write it, column by column of the (rows × columns)
    gradient: each element becomes the mean of its column's non-negative entries or of its negative ones."""
    m = x.reshape(x.shape[0], -1)
    out = torch.empty_like(m)
    for j in range(m.shape[1]):
        col = m[:, j]
        up, down = col[col >= 0], col[col < 0]
        out[:, j] = torch.where(col >= 0, up.mean() if up.numel() else 0.0, down.mean() if down.numel() else 0.0)
    return out.view_as(x)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_bit_sgd_matches_a_reference_written_from_the_paper(momentum):
    """Ours (OneBit with its memory) against the formulation step by step: e ← x − Q(x) with
    x = g + e (Seide et al. 2014), or x = u + e with u ← βu + g (the momentum compressed, as 1-bit
    Adam does), over a 4-D gradient (a convolution's: rows are output channels)."""
    torch.manual_seed(0)
    compressor = OneBit()
    memory = DGCMemory(momentum=momentum, masking=False) if momentum else ErrorFeedback()
    u, e = torch.zeros(8, 3, 3, 3), torch.zeros(8, 3, 3, 3)
    for step in range(6):
        g = torch.randn(8, 3, 3, 3)
        g[2] = 0  # a dead output channel: its zeros count as non-negative in both
        x = memory.compensate("w", g)
        sent = compressor.decompress(compressor.compress(x, step), x)
        memory.update("w", x, sent)
        u = momentum * u + g
        ref_x = (u if momentum else g) + e
        ref_sent = _seide(ref_x)
        e = ref_x - ref_sent
        torch.testing.assert_close(x, ref_x)
        torch.testing.assert_close(sent, ref_sent)


@pytest.mark.parametrize("compressor", [TernGrad(clip=None), TernGrad(), QSGD(4)], ids=["terngrad", "terngrad-clipped", "qsgd"])
def test_stochastic_quantizers_are_unbiased(compressor):
    """Unbiased for the gradient they encode (TernGrad's default first clips it to 2.5 σ, as the paper does)."""
    torch.manual_seed(0)
    x = torch.randn(200)
    draws = 4000
    mean = sum(compressor.decompress(compressor.compress(x, 0), x) for _ in range(draws)) / draws
    if isinstance(compressor, TernGrad) and compressor.clip:
        x = x.clamp(-2.5 * float(x.std()), 2.5 * float(x.std()))
    # each draw's error per element is bounded by max|x| (TernGrad) or ‖x‖/s (QSGD: one bucket of 512)
    bound = x.abs().max() if isinstance(compressor, TernGrad) else x.norm() / compressor.levels
    assert (mean - x).abs().max() < 5 * bound / math.sqrt(draws)


def test_dgc_warms_up_by_default_through_the_papers_stages():
    """Lin et al. 2018, §3.4: 75 % → 93.75 % → 98.4375 % → 99.6 % → 99.9 %, a stage per
    DGC_WARMUP_STEPS steps unless told otherwise, written out in the spec a plan records."""
    spec = parse("dgc:0.999")
    assert spec.canonical() == f"dgc:0.999,clip=1,min_rate=2,min_size=4096,momentum=0.9,warmup={DGC_WARMUP_STEPS}"
    select = _compressor(spec, nccl=False)
    w = DGC_WARMUP_STEPS
    steps = [0, w - 1, w, 2 * w, 3 * w, 4 * w, 100 * w]
    assert [1 - select.density(s) for s in steps] == pytest.approx(
        [0.75, 0.75, 0.9375, 0.984375, 0.996, 0.999, 0.999], abs=2e-3)  # the reference code: 74.9 %, 93.7 %, ...
    assert 1 - _compressor(parse("dgc:0.99,warmup=0"), nccl=False).density(0) == pytest.approx(0.99)
    assert 1 - DGCSelect(0.999, warmup=10).density(25) == pytest.approx(0.984375, abs=2e-3)


def test_dgc_momentum_correction_accumulates_velocity_and_masks_what_was_sent():
    memory = DGCMemory(momentum=0.5)
    g = torch.tensor([[1.0, 2.0]])  # a weight matrix: DGC sparsifies it
    v = memory.compensate("w", g)  # u = g, v = u
    memory.update("w", v, torch.tensor([[1.0, 0.0]]))  # the first coordinate went out
    assert memory.u["w"].tolist() == [[0.0, 2.0]] and memory.v["w"].tolist() == [[0.0, 2.0]]
    v = memory.compensate("w", g)  # u = 0.5·u + g, v += u
    assert memory.u["w"].tolist() == [[1.0, 3.0]] and v.tolist() == [[1.0, 5.0]]
    # a tensor that travels dense (a bias, a small layer): its momentum is kept (plain momentum
    # SGD), nothing is masked
    b = memory.compensate("b", torch.tensor([1.0, 2.0]))
    memory.update("b", b, b, compressed=False)
    assert memory.u["b"].tolist() == [1.0, 2.0] and memory.v["b"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("spec, message", [
    ("zip", "unknown compression 'zip'"),
    ("topk", "give the fraction kept"),
    ("dgc:1.5", "final sparsity in [0, 1)"),
    ("qsgd:300", "levels must be 1 to 127"),
    ("powersgd:1.5", "rank must be a positive integer"),
    ("topk:0.01,ef=no", "values must be numbers"),
    ("dgc:0.999,warmup=-5", "warmup is a number of steps ≥ 0"),
    ("onebit,momentum=1.5", "momentum in [0, 1)"),
    ("dgc:0.999,masking=2", "masking= is DGC's momentum factor masking"),
    ("topk:0.01,masking=0", "masking= is DGC's momentum factor masking"),
])
def test_bad_compression_specs_are_one_clear_message(spec, message):
    with pytest.raises(AutoparError, match=message.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        parse(spec)


def test_biases_small_layers_and_poor_rates_travel_dense():
    """The cost model's rule per tensor: weight matrices of at least min_size elements that shrink
    at least min_rate times (torch's PowerSGD hook's 2×), and, on a known link, where compressing
    is predicted faster than sending dense."""
    dgc = parse("dgc:0.99")
    assert not compresses(dgc, (4096,), 4)  # a bias (or norm): its momentum, all-reduced
    assert not compresses(dgc, (64, 40), 4)  # 2,560 elements: below the 4,096 floor
    assert compresses(dgc, (64, 64), 4) and compresses(parse("dgc:0.99,min_size=0"), (64, 40), 4)
    assert wire(dgc, (64, 64), 4) == ("all_gather", 8 * math.ceil(0.01 * 64 * 64) + 16)  # values, indices, sizes
    # PowerSGD rank 2: 8 × 1024 sends (8 + 1024) · 2 floats, 3.97× fewer; 4 × 1024 1.99×: dense
    assert compresses(parse("powersgd:2"), (8, 1024), 2) and not compresses(parse("powersgd:2"), (4, 1024), 2)
    assert not compresses(parse("dgc:0"), (64, 64), 4)  # keeps everything: its gather would move more than dense
    # on a link as fast as memory, no compressor's passes pay for themselves; on 100 Mb/s they do
    device = nominal_cpu(2, 2**34).device
    fast, slow = Link(bandwidth=device.memory_bandwidth, latency=5e-6), Link(bandwidth=12.5e6, latency=5e-5)
    for text in ("topk:0.01", "dgc:0.999", "powersgd:2", "onebit", "qsgd:16"):
        assert not compresses(parse(text), (1024, 1024), 4, fast, device), text
        assert compresses(parse(text), (1024, 1024), 4, slow, device), text


def _ops_per_unit(rank, world):
    """Ops the runtime dispatches per unit it encodes on one rank (its collectives apart)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.calibrate import COMPRESSORS
    from autopar.runtime.compression import Compressed

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not str(func).startswith("c10d")
            return func(*args, **(kwargs or {}))

    out = {}
    for text in COMPRESSORS:
        compressed = Compressed(text)
        compressed.step = 10**6  # compressing: past every warm-up
        grad = torch.randn(64, 64)
        compressed.average([grad], ["w"], [True])
        with Count() as count:
            compressed.average([grad], ["w"], [True])
        out[parse(text).method] = count.ops
    return out


def test_a_compressors_host_work_is_priced_as_calibrated_or_by_the_ops_it_issues(tmp_path):
    """Uncalibrated, a unit costs the ops the runtime issues for it at the device's cost per op
    (the table counts them: recount it when a compressor changes); calibrated, what `calibrate`
    measured per unit and per element. A method encoding a bucket as one pays per bucket."""
    from autopar.cost_models.compression import _OPS, tensor_time, work

    assert run_ranks(_ops_per_unit, 1, tmp_path)[0] == _OPS
    nominal = dataclasses.replace(nominal_cpu(2, 2**34).device, op_overhead_s=1e-5)
    dgc, n = parse("dgc:0.999"), 256 * 256
    assert work(dgc, (256, 256), 4, nominal) == pytest.approx(
        _OPS["dgc"] * 1e-5 + (4 + 4) * 4 * n / nominal.memory_bandwidth)  # passes, decoding 4 ranks' parts
    measured = dataclasses.replace(nominal, compressor_s={"dgc": [4e-4, 5e-9]})
    assert work(dgc, (256, 256), 4, measured) == pytest.approx(4e-4 + 5e-9 * n + 3 * 4 * n / nominal.memory_bandwidth)
    link = Link(bandwidth=12.5e6, latency=5e-5)
    topk = parse("topk:0.01")
    costly_ops = dataclasses.replace(nominal, op_overhead_s=1.0)  # top-k encodes a bucket as one: its ops are the bucket's
    assert tensor_time(topk, (256, 256), 4, link, nominal) == tensor_time(topk, (256, 256), 4, link, costly_ops)
    assert tensor_time(dgc, (256, 256), 4, link, nominal) < tensor_time(dgc, (256, 256), 4, link, costly_ops)
    # a 64 × 64 gradient on 100 Mb/s saves 1.3 ms sent compressed: a host costing 2 ms a tensor leaves it dense
    slow_host = dataclasses.replace(nominal, compressor_s={"dgc": [2e-3, 0.0]})
    assert compresses(dgc, (64, 64), 2, link, nominal) and not compresses(dgc, (64, 64), 2, link, slow_host)


def test_auto_weighs_what_held_and_a_method_outside_its_measured_range_warns_once(monkeypatch, caplog):
    """`--compression auto` weighs dense and the methods the convergence sweep found within target
    on every model; a plan compressing with a method the sweep did not run as configured, or that
    lost there, or outside the ranks, samples a rank and model sizes it covered, warns once."""
    from autopar.cost_models import compression as cm
    from autopar.planner import search

    swept = {"schema": "autopar.compression_verdict/1", "models": ["digits MLP", "digits CNN"],
             "range": {"ranks": [2, 4], "local_batch": [16, 128], "params": [9_898, 85_002]},
             "methods": {"powersgd:2": {"held": True, "target": 1.0, "worst_gap": -0.1},
                         "terngrad": {"held": False, "target": 2.0, "worst_gap": -2.5}}}
    monkeypatch.setattr(cm, "verdict", lambda: swept)
    assert cm.auto_candidates() == (None, "powersgd:2")
    assert cm.unmeasured(parse("powersgd:2"), 4, 32, 50_000) is None
    assert "not run to convergence" in cm.unmeasured(parse("powersgd:2,start=0"), 4, 32, 50_000)
    assert "lost 2.50 points" in cm.unmeasured(parse("terngrad"), 4, 32, 50_000)
    outside = cm.unmeasured(parse("powersgd:2"), 8, 32, 124_000_000)
    assert "data-parallel ranks 8, measured 2–4" in outside and "parameters 124,000,000" in outside
    assert "samples a rank" not in outside
    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search

    start = search.Search.start(autopar.load_workload("mlp-tiny", batch=64), get_cluster("a100-dgx").over_link(
        Link(bandwidth=12.5e6, latency=5e-5)), (1, 2), compression="powersgd:2")
    plan = manual_plan(manual_search(start), Layout(2, 1, 1, 1))
    monkeypatch.setattr(search, "_WARNED", set())
    with caplog.at_level("WARNING"):
        search.warn_unmeasured(plan, 124_000_000)
        search.warn_unmeasured(plan, 124_000_000)
    assert len([r for r in caplog.records if "outside what it measured" in r.message]) == 1


def test_the_shipped_verdict_covers_both_models_and_auto_weighs_what_held():
    """The package ships the convergence sweep's verdict: every method with a target, on both
    models, over 2 and 4 ranks; `auto` weighs dense and those that held."""
    from autopar.cost_models import compression as cm

    v = cm.verdict()
    assert v["schema"] == "autopar.compression_verdict/1" and v["range"]["ranks"] == [2, 4]
    assert {"powersgd:2", "topk:0.01", "dgc:0.999", "onebit", "terngrad", "qsgd:16"} <= set(v["methods"])
    assert all(set(m["tasks"]) == {"mlp", "cnn"} for m in v["methods"].values())
    assert cm.auto_candidates() == (None, *(t for t, m in v["methods"].items() if m["held"]))


def test_specs_parse():
    spec = parse("dgc:0.999,warmup=100,momentum=0.9")
    assert (spec.method, spec.arg, spec.options) == ("dgc", 0.999, {"warmup": 100.0, "momentum": 0.9})


# ---- on gloo ranks ----------------------------------------------------------------------------------


def _wire(rank, world):
    """Bytes each method hands to collectives for known tensors, and the cases that must equal a
    plain all-reduce."""
    import torch.distributed as dist

    from autopar.runtime.compression import Compressed

    out = {}
    torch.manual_seed(rank)
    w = torch.randn(64, 40)
    for text in ["fp16", "topk:0.01,warmup=0", "randk:0.05", "powersgd:2,start=0", "onebit,start=0", "terngrad", "qsgd:16",
                 "signsgd"]:
        c = Compressed(text, None)
        c.average([w], ["w"])
        out[text] = c.bytes_sent
    exact = torch.randint(-64, 64, (64, 40)).float() / 8  # fp16 holds these and their halves exactly
    summed = exact.clone()
    dist.all_reduce(summed)
    out["fp16-equal"] = torch.equal(Compressed("fp16").average([exact], ["e"])[0], summed / world)
    summed = w.clone()
    dist.all_reduce(summed)
    full = Compressed("powersgd:40,start=0").average([w], ["w"])[0]  # rank 40 = min(64, 40): full rank
    out["powersgd-full-rank-error"] = float((full - summed / world).abs().max())
    # half kept: gathering would move as much as a dense all-reduce, so the tensors travel whole in one
    for text in ("topk:0.5,warmup=0", "dgc:0.5,warmup=0,clip=0"):
        c = Compressed(text)
        got = c.average([w], ["w"])[0]
        [left] = (c.memory.v if text.startswith("dgc") else c.memory.residual).values()  # top-k's key: the bucket's
        out[text] = (float((got - summed / world).abs().max()), float(left.abs().max()), c.collectives[-1],
                     bool((c.memory.u["w"] != 0).all()) if text.startswith("dgc") else True)
    # DGC compressing (1 % kept): momentum factor masking clears what was sent, `masking=0` keeps it
    for text in ("dgc:0.99,warmup=0,clip=0", "dgc:0.99,warmup=0,clip=0,masking=0"):
        c = Compressed(text)
        c.average([w], ["w"])
        out[text] = int((c.memory.u["w"] == 0).sum())
    # delayed averaging, D = 2: rank r's gradient at step t is (r + 1)(t + 1)
    from autopar.runtime.delayed import DelayedSync

    p = torch.nn.Parameter(torch.zeros(3))
    sync = DelayedSync([p], None, delay=2)
    out["dga"] = []
    for t in range(5):
        p.grad = torch.full((3,), float((rank + 1) * (t + 1)))
        sync.finish()
        out["dga"].append(p.grad[0].item())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_on_the_wire_match_the_formulas(tmp_path, world):
    n, rows, cols = 64 * 40, 64, 40
    expected = {
        "fp16": 2 * n,
        "topk:0.01,warmup=0": math.ceil(0.01 * n) * (4 + 4),  # fp32 values + int32 indices
        "randk:0.05": math.ceil(0.05 * n) * 4,  # shared indices: values only
        "powersgd:2,start=0": (rows + cols) * 2 * 4,  # P and Q
        "onebit,start=0": n // 8 + 2 * cols * 4,  # a bit per element, two fp32 per column
        "terngrad": n // 4 + 4,  # 2 bits per element, one fp32 scale
        "qsgd:16": n + 4 * n // 512,  # int8 per element, an fp32 norm per bucket of 512
        "signsgd": n // 8,
    }
    for text, nbytes in expected.items():  # the planner prices what the runtime sends
        assert wire(parse(text), (rows, cols), world)[1] == nbytes
    ranks = run_ranks(_wire, world, tmp_path)
    for got in ranks:
        assert {k: got[k] for k in expected} == expected
        assert got["fp16-equal"]
        assert got["powersgd-full-rank-error"] < 1e-5
        # the exact average, nothing left behind, DGC's momentum not masked (as at 0 % sparsity)
        for text in ("topk:0.5,warmup=0", "dgc:0.5,warmup=0,clip=0"):
            error, residual, last, unmasked = got[text]
            assert error < 1e-6 and residual == 0 and unmasked and last == ("all_reduce", 4 * n)
        # about 1 % of the momentum cleared (DGC's sampled threshold keeps about k), none without masking
        assert 0 < got["dgc:0.99,warmup=0,clip=0"] <= 1.3 * math.ceil(0.01 * n)
        assert got["dgc:0.99,warmup=0,clip=0,masking=0"] == 0
    # step t applies g_t − g_{t−2} + avg_{t−2} (the local gradient alone for t < 2)
    mean = sum(range(1, world + 1)) / world
    for rank, got in enumerate(ranks):
        g = [(rank + 1) * (t + 1) for t in range(5)]
        assert got["dga"] == pytest.approx(g[:2] + [g[t] - g[t - 2] + mean * (t - 1) for t in range(2, 5)])


def _train(rank, world, methods, cluster):
    out = {}
    for method in methods:
        torch.manual_seed(0)
        w = autopar.load_workload("mlp-tiny", batch=8, device="cpu")
        carried = "@" not in method and not method.startswith(("delay", "none")) and carries_momentum(parse(method))
        delay = int(method.split(":")[1]) if method.startswith("delay") else 0

        def optimizer(params, carried=carried):  # DGC and 1-bit SGD carry the momentum themselves
            return torch.optim.SGD(params, lr=0.1, momentum=0.0 if carried else 0.9)

        method, _, layout = method.partition("@")  # a layout other than pure data parallelism
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                                 plan=layout or f"{world},1,1", delay=delay, cluster=cluster,
                                 compression=None if delay or method == "none" else method)
        start = pm.full_state_dict()
        if delay:
            pm.sync.resync = 4  # the replicas average their parameters after step 4
        g = torch.Generator().manual_seed(5)
        losses, states = [], []
        for _ in range(4):
            losses.append(pm.step(*w.make_batch(8, g)))
            states.append(pm.full_state_dict())
        moved = torch.cat([(states[-1][k] - start[k]).reshape(-1) for k in sorted(start)])
        out[method + (f"@{layout}" if layout else "")] = (losses, states, pm.comm_stats()["dp"], moved,
                                                          pm.plan.dp_gradient["compression"],
                                                          pm.plan.dp_gradient["compressed"])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_trains_on_gloo_and_keeps_replicas_identical(tmp_path, world):
    methods = ["none"] + METHODS + ["dgc:0,momentum=0.9,clip=0", "delay:2"] + (
        ["powersgd:2,start=0,min_size=0@2,1,2,2"] if world == 4 else [])
    ranks = run_ranks(_train, world, tmp_path, methods, slow_link(tmp_path, world))
    dense = ranks[0]["none"][3]
    for method in methods:
        # after 4 steps the compressed updates point where dense training's do (a compressor sending
        # nothing, or noise, scores 0): fully for the methods that are dense in effect here
        cosine = float(torch.nn.functional.cosine_similarity(ranks[0][method][3], dense, dim=0))
        assert cosine > (0.999 if method in ("fp16", "dgc:0,momentum=0.9,clip=0", "delay:2") else 0.15), (method, cosine)
        first = ranks[0][method]
        for other in ranks[1:]:
            assert other[method][0] == first[0]  # the same global loss on every rank
            for step, (a, b) in enumerate(zip(first[1], other[method][1])):
                for key in a:
                    if not (method.startswith("delay") and step < 3):  # DGA: equal once re-synchronised
                        assert torch.equal(a[key], b[key]), (method, step, key)
            if method.startswith("delay"):  # before that, each applied its own last local gradients
                assert any(not torch.equal(first[1][0][k], other[method][1][0][k]) for k in first[1][0])
        raw, sent = first[2]["bytes_raw"], first[2]["bytes_sent"]
        if method == "none":
            continue
        if "@" not in method:  # a pipeline stage averages its own parameters only
            assert raw == sum(p.numel() * 4 for p in first[1][0].values())
        if method.split("@")[0].split(":")[0].split(",")[0] in ("dgc", "topk", "powersgd", "onebit", "signsgd",
                                                                 "terngrad") and method != "dgc:0,momentum=0.9,clip=0":
            assert sent < raw / 8, method
            # every weight matrix travels compressed on this link, the biases dense
            assert first[5] == sorted(k for k in first[1][0] if k.endswith("weight")), method
    # the plan records every option the compressor ran with, defaults written out
    assert ranks[0][METHODS[3]][4] == "dgc:0.99,clip=1,min_rate=2,min_size=0,momentum=0.9,warmup=0"
    assert ranks[0][METHODS[5]][4] == "onebit,min_rate=2,min_size=0,momentum=0.9,start=0"
    # DGC at 0 % sparsity with its momentum correction, unclipped, is momentum SGD (and its dense fallback)
    losses, params = _single("mlp-tiny")
    dense = ranks[0]["dgc:0,momentum=0.9,clip=0"]
    _assert_same_training(dense[0][:3], dense[1][2], losses, params)


# ---- beside torch's own PowerSGD, and 1-bit SGD where it diverged -----------------------------------


def _beside_torch_powersgd(rank, world):
    """Six steps of a 3-layer MLP through torch's DDP PowerSGD hook (rank 2, start_powerSGD_iter 3,
    min_compression_rate 2, error feedback, warm start, random_seed 0) and through ours
    ("powersgd:2,start=3": its defaults but the start, and no size floor, which torch's hook has
    not): the same bucket (DDP's, as backward fills it, and ours), the same first Q (drawn as the
    hook draws it); each step's averaged gradients from both."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.runtime.compression import Compressed
    from autopar.runtime.grad_sync import GradSync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 3))
    plain = torch.nn.Sequential(*(torch.nn.Linear(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear)
                                  else m for m in model))
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model)
    state = psgd.PowerSGDState(dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=3,
                               min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    spec = "powersgd:2,start=3,min_size=0"
    params = list(plain.parameters())
    sync = GradSync(params, compressed=Compressed(spec), travels={
        p: compresses(parse(spec), tuple(p.shape), world) for p in params})
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    out = []
    for _ in range(6):
        x = torch.randn(16, 20, generator=gen)
        model.zero_grad()
        ddp(x).pow(2).mean().backward()
        plain.zero_grad()
        plain(x).pow(2).mean().backward()
        sync.finish()
        out.append([(a.grad.clone(), b.grad.clone()) for a, b in zip(model.parameters(), params)])
    return out


def test_powersgd_dense_start_matches_torchs_hook_step_for_step(tmp_path):
    """Over the dense start both all-reduce plainly (equal to float rounding); from step 3 both
    compress the two hidden matrices (the 3 × 32 head saves under 2×: dense in both) from the same
    random Q. torch orthogonalises with Gram-Schmidt at rank 2, ours with Householder QR: the same
    approximation in exact arithmetic, so the averages agree to float rounding: within 1e-5 of the
    largest entry of each gradient."""
    steps = run_ranks(_beside_torch_powersgd, 2, tmp_path)[0]
    assert len(steps) == 6
    for step, pairs in enumerate(steps):
        for k, (theirs, mine) in enumerate(pairs):
            scale = float(theirs.abs().max())
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * scale, msg=f"step {step}, tensor {k}")
    # compressed from step 3: a rank-2 approximation, not the dense average
    first, later = steps[2][0], steps[3][0]
    assert torch.linalg.matrix_rank(later[1]) == 2 and torch.linalg.matrix_rank(first[1]) > 2


def _floor(rank, world, clusters):
    """mlp-tiny under top-k 1 % on 100 Mb/s with the default size floor, per cluster: which tensors
    the plan lists, the bytes the runtime hands to collectives in a step, what it issued, and the
    shapes in backward order."""
    out = []
    for cluster in clusters:
        torch.manual_seed(0)
        w = autopar.load_workload("mlp-tiny", batch=8, device="cpu")
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan=f"{world},1,1",
                                 cluster=cluster, compression="topk:0.01,warmup=0",
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        g = torch.Generator().manual_seed(5)
        pm.step(*w.make_batch(8, g))
        named = [(n, tuple(p.shape)) for n, p in w.model.named_parameters()][::-1]  # as backward produces them
        out.append((pm.plan.dp_gradient["compressed"], pm.comm_stats()["dp"], pm.issued(), named,
                    pm.sync.compressed is None))
    return out


def test_a_tensor_below_the_size_floor_or_in_a_latency_bound_bucket_travels_dense_in_plan_runtime_and_price(
        tmp_path):
    """Per tensor, the size floor; per bucket, the collectives compression adds: at a latency of
    2 ms each (gloo over a slow network) mlp-tiny's one bucket is priced slower compressed, so the
    plan lists nothing and the runtime sends one dense all-reduce."""
    world, links = 2, [Link(bandwidth=12.5e6, latency=5e-5), Link(bandwidth=12.5e6, latency=2e-3)]
    clusters = []
    for k, link in enumerate(links):
        clusters.append(str(tmp_path / f"link{k}.json"))
        nominal_cpu(2, 24 * 2**30).with_ranks(world).over_link(link).save(clusters[-1])
    (listed, stats, issued, named, plain), (none, stats_slow, issued_slow, _, plain_slow) = run_ranks(
        _floor, world, tmp_path, clusters)[0]
    # 64 × 64 twice compress; 64 × 32 (2,048 elements) and the 10 × 64 head are below 4,096: dense
    assert listed == ["layers.1.fc.weight", "layers.2.fc.weight"]
    spec, shapes = parse("topk:0.01,warmup=0"), [s for _, s in named]
    flags = [n in listed for n, _ in named]
    device = nominal_cpu(2, 2**34).device
    assert flags == decide(spec, shapes, world, links[0], device)
    assert stats["bytes_sent"] == sent_bytes(spec, shapes, world, flags)  # what ran is what was priced
    dense = 4 * sum(math.prod(s) for s, f in zip(shapes, flags) if not f)
    assert {"axis": "dp", "kind": "all_reduce", "bytes": dense} in issued
    # the latency-bound bucket: each matrix alone would compress, the bucket goes dense
    assert [compresses(spec, s, world, links[1], device) for s in shapes] == flags
    assert none == [] and not any(decide(spec, shapes, world, links[1], device))
    everything = 4 * sum(math.prod(s) for s in shapes)
    assert stats_slow["bytes_sent"] == everything == sent_bytes(spec, shapes, world, [False] * len(shapes))
    assert [c["kind"] for c in issued_slow if c["axis"] == "dp"] == ["all_reduce"]
    # compressing nothing, top-k runs as dense training: the plain synchroniser, overlapped with
    # backward; so do DGC and 1-bit SGD, their momentum applied around it (the next test)
    assert not plain and plain_slow
    assert runs_dense(spec, False) and not runs_dense(spec, True)
    assert runs_dense(parse("dgc:0.999"), False) and runs_dense(parse("onebit"), False)
    assert not runs_dense(parse("signsgd"), False)  # a vote on every gradient, compressed or not


def _momentum_without_compressing(rank, world):
    """Six steps of a small MLP, each rank its own data: DGC (its local clipping biting: clip 0.05)
    and 1-bit SGD with nothing compressed, through the compressor (every gradient dense, as they
    ran until 2026-12-07) and through the plain synchroniser with their memory; the largest
    difference of the resulting gradients relative to the largest entry, the buckets launched in
    backward and the memories' keys."""
    import copy

    from autopar.runtime.compression import Compressed, momentum_memory
    from autopar.runtime.grad_sync import GradSync

    out = {}
    for text in ("dgc:0.999,clip=0.05", "onebit"):
        torch.manual_seed(0)
        a = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3))
        b = copy.deepcopy(a)
        through = GradSync(list(a.parameters()), compressed=Compressed(text), travels=dict.fromkeys(a.parameters(), False))
        plain = GradSync(list(b.parameters()), momentum=momentum_memory(parse(text), world))
        gen = torch.Generator().manual_seed(100 + rank)
        worst = 0.0
        for _ in range(6):
            x = torch.randn(16, 20, generator=gen)
            for model, sync in ((a, through), (b, plain)):
                model.zero_grad(set_to_none=True)
                sync.before_backward()
                model(x).pow(2).sum().backward()
                sync.finish()
            for p, q in zip(a.parameters(), b.parameters()):
                worst = max(worst, float((p.grad - q.grad).abs().max() / p.grad.abs().max()))
        out[text] = (worst, plain.stats.overlapped, sorted(through.compressed.memory.u) == sorted(plain.momentum.u),
                     sorted(plain.state_dict()["memory"]["u"]) == sorted(plain.momentum.u))
    return out


def test_dgc_and_one_bit_compressing_nothing_average_as_dense_with_their_momentum_around_it(tmp_path):
    """Where the plan compresses nothing, DGC and 1-bit SGD run through the plain synchroniser, its
    buckets launched in backward: each rank's gradient clipped before it is sent, their momentum on
    the average. The same gradients as averaging each rank's momentum through the compressor (it is
    linear): equal to float rounding, within 1e-5 of the largest entry."""
    for got in run_ranks(_momentum_without_compressing, 2, tmp_path):
        for text, (worst, overlapped, same_keys, saved) in got.items():
            assert worst < 1e-5 and overlapped > 0 and same_keys and saved, text


def test_compression_is_decided_per_bucket_where_it_makes_the_bucket_faster():
    """`decide` keeps a bucket's tensors dense where compressing them would not make the bucket's
    priced exchange faster (the collectives it adds each cost a latency), or faster by less than
    `min_rate` (2×, torch's hook's `min_compression_rate`), and compresses a bucket that gains that
    much: never priced slower than all dense or than each tensor's own decision where it does."""
    device = nominal_cpu(2, 2**34).device
    dgc = parse("dgc:0.999")
    # backward order: a 1 MiB matrix closes the first bucket; the second holds a small layer
    shapes = [(10,), (512, 512), (64,), (64, 80), (64,)]
    for ranks in (2, 4):
        gloo = Link(bandwidth=12.5e6, latency=1e-3)
        chosen = decide(dgc, shapes, ranks, gloo, device)
        alone = [compresses(dgc, s, ranks, gloo, device) for s in shapes]
        assert alone == [False, True, False, True, False]
        assert chosen == [False, True, False, False, False]  # the second bucket's 20 KB: latency-bound
        priced = {name: sync_time(dgc, shapes, ranks, gloo, device, flags) for name, flags in (
            ("chosen", chosen), ("alone", alone), ("dense", [False] * len(shapes)))}
        assert priced["chosen"] == sync_time(dgc, shapes, ranks, gloo, device) == min(priced.values())
        # on 10 Mb/s the small layer's bytes outweigh the latency: its bucket is priced 3.4× faster
        # compressed on 2 ranks, which takes it, and 1.98× on 4, short of the default rate
        slow = Link(bandwidth=1.25e6, latency=1e-3)
        assert decide(dgc, shapes, ranks, slow, device) == (alone if ranks == 2 else chosen)
        assert decide(parse("dgc:0.999,min_rate=1"), shapes, ranks, slow, device) == alone


def _one_bit_at_a_large_step(rank, world):
    """The digits MLP of the compression benchmark at lr 0.2 with momentum 0.9, batch 64, 200 steps:
    where 1-bit SGD with error feedback on the gradient (beside the optimizer's momentum) collapsed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import torch.nn.functional as F
    from compression import batch_stream, link_cluster, load_data, method, mlp

    torch.set_num_threads(1)  # four ranks on this machine's cores: more threads only contend
    data = load_data(0)
    out = {}
    # every weight matrix compressed, the 256 × 10 head too: with the size floor's default it travels
    # dense, and Seide's form then held 88 % here (one seed): the floor is part of what keeps it safe
    for spec in (None, "onebit,momentum=0,min_size=0,start=0", "onebit,min_size=0,start=0"):
        m = method(str(spec), spec, 0.2)
        pm = autopar.parallelize(mlp(256, 0), (1, world), (data.x_train[:64],), loss_fn=F.cross_entropy,
                                 optimizer=lambda ps, m=m: torch.optim.SGD(ps, lr=m.lr, momentum=m.momentum),
                                 plan=f"{world},1,1", compression=spec, cluster=link_cluster(world))
        stream = batch_stream(data, 64, 0)
        for _ in range(200):
            pm.step(*next(stream))
        model = mlp(256, None)
        model.load_state_dict(pm.full_state_dict())
        with torch.no_grad():
            out[str(spec)] = 100 * float((model(data.x_test).argmax(1) == data.y_test).float().mean())
    return out


def test_one_bit_sgd_trains_where_error_feedback_on_the_gradient_collapsed(tmp_path):
    pytest.importorskip("sklearn")
    got = run_ranks(_one_bit_at_a_large_step, 4, tmp_path)[0]
    assert got["None"] > 90  # dense training holds at this step size
    assert got["onebit,momentum=0,min_size=0,start=0"] < 50  # Seide's form beside the optimizer's momentum: the residual runs away
    # the momentum compressed with error feedback trains: seeds 0-5 (data split, weights, batches) at
    # these 200 steps measured 70.0-92.7 % against dense's 94.0-95.6 and the collapsed form's 9.6-21.3
    # (chance: 10); how close it comes to dense depends on the seed at 200 steps, so only the rescue is asserted
    assert got["onebit,min_size=0,start=0"] > 60


def test_plans_list_what_they_compress_and_older_plans_compress_every_matrix():
    """Schema 4 lists the parameters a compressor takes; schema 3 files (none listed) load and run
    every weight matrix compressed, as they were priced; a list naming no parameter of the plan is
    one clear message."""
    import json

    from autopar.contract.plan import Plan, PlanError
    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search

    cluster = get_cluster("a100-dgx").over_link(Link(bandwidth=12.5e6, latency=5e-5))
    search = Search.start(autopar.load_workload("gpt-tiny", batch=8), cluster, (1, 2), compression="powersgd:2")
    plan = manual_plan(manual_search(search), Layout(2, 1, 1, 1))
    data = plan.to_dict()
    listed = data["dp_gradient"]["compressed"]
    weights = {f: tuple(search.graph.params[f].shape) for f in search.graph.params if f in search.graph.trainable}
    backward = list(weights)[::-1]
    chosen = decide(search.costs.compression, [weights[f] for f in backward], 2, cluster.intra_host, cluster.device)
    assert listed == sorted(f for f, c in zip(backward, chosen) if c)
    assert listed and not any(len(weights[f]) < 2 for f in listed)
    old = {**data, "schema": "autopar.plan/3",
           "dp_gradient": {k: v for k, v in data["dp_gradient"].items() if k != "compressed"}}
    assert Plan.from_json(json.dumps(old)).dp_gradient["compressed"] is None
    assert plan.with_gradient(compression="fp16").dp_gradient["compressed"] is None  # another compressor: re-decided
    bad = {**data, "dp_gradient": {**data["dp_gradient"], "compressed": ["no.such.weight"]}}
    with pytest.raises(PlanError, match="dp_gradient.compressed must list parameters of the plan's stages"):
        Plan.from_json(json.dumps(bad))


def test_a_compressor_that_compresses_nothing_is_priced_as_the_program_it_runs():
    """Where no bucket is worth compressing, top-k's and DGC's plans run dense averaging overlapped
    with backward (DGC's momentum around it) and are priced as dense's."""
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search

    cluster = nominal_cpu(2, 24 * 2**30).with_ranks(2).over_link(Link(bandwidth=12.5e6, latency=2e-3))
    workload = autopar.load_workload("mlp-tiny", batch=8)
    plans = {text: manual_plan(manual_search(Search.start(workload, cluster, (1, 2), compression=text)),
                               Layout(2, 1, 1, 1)) for text in (None, "topk:0.01", "dgc:0.999")}
    assert plans["topk:0.01"].dp_gradient["compressed"] == plans["dgc:0.999"].dp_gradient["compressed"] == []
    assert plans["topk:0.01"].estimate.step_time_s == plans[None].estimate.step_time_s
    assert plans["dgc:0.999"].estimate.step_time_s == plans[None].estimate.step_time_s
