"""Gradient compression and delayed averaging on the data axis: the compressors' contracts, the
bytes they hand to collectives, and training on gloo ranks with replicas kept identical."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar import AutoparError
from autopar.contract.compression import DGC_WARMUP_STEPS, carries_momentum, parse
from autopar.cost_models.compression import wire
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

METHODS = ["fp16", "topk:0.01", "randk:0.05", "dgc:0.99,warmup=0", "powersgd:2", "onebit", "threshold:0.001",
           "terngrad", "qsgd:16", "signsgd"]


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
    assert spec.canonical() == f"dgc:0.999,momentum=0.9,warmup={DGC_WARMUP_STEPS}"
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
    # a bias travels dense: its momentum is kept (plain momentum SGD), nothing is masked
    b = memory.compensate("b", torch.tensor([1.0, 2.0]))
    memory.update("b", b, b)
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
])
def test_bad_compression_specs_are_one_clear_message(spec, message):
    with pytest.raises(AutoparError, match=message.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        parse(spec)


def test_dgc_prices_biases_dense_and_matrices_sparse():
    spec = parse("dgc:0.99")
    assert wire(spec, (40,), 4) == ("all_reduce", 4 * 40)  # a bias: its momentum, all-reduced
    assert wire(spec, (64, 40), 4) == ("all_gather", 8 * math.ceil(0.01 * 64 * 40) + 16)  # values, indices, sizes


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
    for text in ["fp16", "topk:0.01", "randk:0.05", "powersgd:2", "onebit", "terngrad", "qsgd:16", "signsgd"]:
        c = Compressed(text, None)
        c.average([w], ["w"])
        out[text] = c.bytes_sent
    exact = torch.randint(-64, 64, (64, 40)).float() / 8  # fp16 holds these and their halves exactly
    summed = exact.clone()
    dist.all_reduce(summed)
    out["fp16-equal"] = torch.equal(Compressed("fp16").average([exact], ["e"])[0], summed / world)
    summed = w.clone()
    dist.all_reduce(summed)
    full = Compressed("powersgd:40").average([w], ["w"])[0]  # rank 40 = min(64, 40): full rank
    out["powersgd-full-rank-error"] = float((full - summed / world).abs().max())
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
        "topk:0.01": math.ceil(0.01 * n) * (4 + 4),  # fp32 values + int32 indices
        "randk:0.05": math.ceil(0.05 * n) * 4,  # shared indices: values only
        "powersgd:2": (rows + cols) * 2 * 4,  # P and Q
        "onebit": n // 8 + 2 * cols * 4,  # a bit per element, two fp32 per column
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
    # step t applies g_t − g_{t−2} + avg_{t−2} (the local gradient alone for t < 2)
    mean = sum(range(1, world + 1)) / world
    for rank, got in enumerate(ranks):
        g = [(rank + 1) * (t + 1) for t in range(5)]
        assert got["dga"] == pytest.approx(g[:2] + [g[t] - g[t - 2] + mean * (t - 1) for t in range(2, 5)])


def _train(rank, world, methods):
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
                                 plan=layout or f"{world},1,1", delay=delay,
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
                                                          pm.plan.dp_gradient["compression"])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_trains_on_gloo_and_keeps_replicas_identical(tmp_path, world):
    methods = ["none"] + METHODS + ["dgc:0,momentum=0.9", "delay:2"] + (["powersgd:2@2,1,2,2"] if world == 4 else [])
    ranks = run_ranks(_train, world, tmp_path, methods)
    dense = ranks[0]["none"][3]
    for method in methods:
        # after 4 steps the compressed updates point where dense training's do (a compressor sending
        # nothing, or noise, scores 0): fully for the methods that are dense in effect here
        cosine = float(torch.nn.functional.cosine_similarity(ranks[0][method][3], dense, dim=0))
        assert cosine > (0.999 if method in ("fp16", "dgc:0,momentum=0.9", "delay:2") else 0.15), (method, cosine)
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
        if method.split("@")[0] in ("dgc:0.99,warmup=0", "topk:0.01", "powersgd:2", "onebit", "signsgd", "terngrad"):
            assert sent < raw / 8, method
    # the plan records every option the compressor ran with, defaults written out
    assert ranks[0]["dgc:0.99,warmup=0"][4] == "dgc:0.99,momentum=0.9,warmup=0"
    assert ranks[0]["onebit"][4] == "onebit,momentum=0.9"
    # DGC at 0 % sparsity with its momentum correction is momentum SGD (and its dense fallback)
    losses, params = _single("mlp-tiny")
    dense = ranks[0]["dgc:0,momentum=0.9"]
    _assert_same_training(dense[0][:3], dense[1][2], losses, params)


# ---- beside torch's own PowerSGD, and 1-bit SGD where it diverged -----------------------------------


def _beside_torch_powersgd(rank, world):
    """Three PowerSGD steps on one weight matrix (64 × 40, rank 2), through torch's DDP hook and
    through ours, from the same Q; the weights stay put, the data changes every step."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.runtime.compression import Compressed

    torch.manual_seed(0)
    model = torch.nn.Linear(40, 64, bias=False)
    plain = torch.nn.Linear(40, 64, bias=False)
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model)
    state = psgd.PowerSGDState(dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=2,
                               min_compression_rate=0, use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    ours = Compressed("powersgd:2")
    q = torch.randn(40, 2, generator=torch.Generator().manual_seed(7))  # the same start on both sides
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(5):
        if step == 2:  # torch's hook all-reduced densely until start_powerSGD_iter: now both start from q
            state.p_memory_dict[0] = torch.empty(64 * 2)
            state.q_memory_dict[0] = q.reshape(-1).clone()
            ours.compressor._q["w"] = q.clone()
        x = torch.randn(16, 40, generator=gen)
        model.zero_grad()
        ddp(x).pow(2).mean().backward()
        if step < 2:
            continue
        plain.zero_grad()
        plain(x).pow(2).mean().backward()
        mine = ours.average([plain.weight.grad], ["w"])[0]
        out.append((model.weight.grad.clone(), mine, state.error_dict[0].view(64, 40).clone(),
                    ours.memory.residual["w"].clone()))
    return out


def test_our_powersgd_agrees_with_torchs_hook_from_the_same_start(tmp_path):
    """torch orthogonalises Q before P = MQ (Gram-Schmidt), ours does not and takes P's QR
    (Householder): the same approximation in exact arithmetic, so the averages and the error-feedback
    residuals agree to float rounding, step after step (warm start): within 1e-5 of the largest entry
    (measured: 4e-8 to 2e-7 in norm against 0.09 to 0.17)."""
    for steps in run_ranks(_beside_torch_powersgd, 2, tmp_path):
        assert len(steps) == 3
        for theirs, mine, their_error, my_error in steps:
            scale = float(theirs.abs().max())
            assert scale > 0
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * scale)
            torch.testing.assert_close(my_error, their_error, rtol=0, atol=1e-5 * float(their_error.abs().max()))


def _one_bit_at_a_large_step(rank, world):
    """The digits MLP of the compression benchmark at lr 0.2 with momentum 0.9, batch 64, 200 steps:
    where 1-bit SGD with error feedback on the gradient (beside the optimizer's momentum) collapsed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import torch.nn.functional as F
    from compression import batch_stream, load_data, method, mlp

    torch.set_num_threads(1)  # four ranks on this machine's cores: more threads only contend
    data = load_data(0)
    out = {}
    for spec in (None, "onebit,momentum=0", "onebit"):
        m = method(str(spec), spec, 0.2)
        pm = autopar.parallelize(mlp(256, 0), (1, world), (data.x_train[:64],), loss_fn=F.cross_entropy,
                                 optimizer=lambda ps, m=m: torch.optim.SGD(ps, lr=m.lr, momentum=m.momentum),
                                 plan=f"{world},1,1", compression=spec)
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
    assert got["onebit,momentum=0"] < 50  # Seide's form beside the optimizer's momentum: the residual runs away
    # the momentum compressed with error feedback trains: seeds 0-5 (data split, weights, batches) at
    # these 200 steps measured 70.0-92.7 % against dense's 94.0-95.6 and the collapsed form's 9.6-21.3
    # (chance: 10); how close it comes to dense depends on the seed at 200 steps, so only the rescue is asserted
    assert got["onebit"] > 60
