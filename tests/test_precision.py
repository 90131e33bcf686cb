"""Mixed precision as planned, on 2 and 4 gloo ranks: a plan priced for bf16 or fp16 trains with
its matmuls in 16 bits, fp32 master weights and optimizer state, losses that track one process in
fp32 (over 3 Adam steps, bf16 within rel 1e-3, fp16 with loss scaling within 1e-4; the plans in
fp32 train as one process does within 1e-5: `tests/test_parallelize.py`), under every layout kind;
and a run that asks for another precision than its plan's is refused with one message."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.contract.errors import AutoparError
from autopar.contract.placements import Shard
from autopar.contract.precision import PRECISIONS
from tests.distributed import on_rank0, shared_ranks
from tests.families import TEST_LAYERS
from tests.families import workload as family
from tests.test_parallelize import _staged

STEPS = 3
TOLERANCE = {"bf16": 1e-3, "fp16": 1e-4}  # measured against the same plan in fp32: at most 3.6e-5 and 6.9e-6
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}
# one stage: DP, TP, ZeRO-3 (FSDP2's MixedPrecisionPolicy); torch's 1F1B over rotary stages; an
# MoE's DP×TP; the fan-out executor (stages of 2 + 1 + 1 ranks)
CASES = {2: [("gpt-tiny", "2,1,1"), ("gpt-tiny", "1,2,1"), ("gpt-tiny", "zero3:2,1,1"), ("llama", "1,1,2,2"),
             ("gpt-tiny", "mismatch")],
         4: [("moe-tiny", "2,2,1"), ("gpt-tiny", "2+1+1"), ("gpt-tiny", "2,1,2,2")]}


class _Matmuls(TorchDispatchMode):
    """The dtypes matmuls compute in (DTensor's local ops included)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATMULS:
            first = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, torch.Tensor) and not type(first).__name__ == "DTensor":
                self.dtypes.add(first.dtype)
        return out


def _plan(w, world, layout):
    """The layout planned for bf16, on rank 0 (the fp16 run takes the same plan with its precision
    replaced: the same placements, so only the precision differs)."""
    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search

    if layout == "2+1+1":
        return dataclasses.replace(_staged(w, world, ((1, 2), (1, 1), (1, 1)), "1f1b", 4), precision="bf16")

    def planned():
        cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=world)
        search = Search.start(w, cluster, (1, world), precision="bf16")
        plan = manual_plan(manual_search(search), Layout.parse(layout.removeprefix("zero3:")))
        if layout.startswith("zero3:"):
            for stage in plan.stages:
                stage.params = {f: [Shard(0), p[1]] for f, p in stage.params.items()}
        return plan

    return on_rank0(planned)


def _setup(name):
    torch.manual_seed(0)
    w = family(name, layers=TEST_LAYERS) if name == "llama" else autopar.load_workload(name, batch=8, device="cpu")
    gen = torch.Generator().manual_seed(5)
    return w, [w.make_batch(w.batch, gen) for _ in range(STEPS)]


def _train(rank, world, name, layout):
    if layout == "mismatch":  # another precision than the plan's; fp16 with a compressor
        said = []
        for precision, compression in (("fp32", None), ("fp16", "powersgd:2")):
            w, _ = _setup(name)
            plan = dataclasses.replace(_plan(w, world, "2,1,1"), precision=precision if precision != "fp32" else "bf16")
            try:
                autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan=plan,
                                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), mixed_precision=precision,
                                    compression=compression)
                said.append(None)
            except AutoparError as exc:
                said.append(str(exc))
        return said
    runs = {}
    plan = _plan(_setup(name)[0], world, layout)
    for precision in ("bf16", "fp16"):
        w, batches = _setup(name)
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                 plan=dataclasses.replace(plan, precision=precision), mixed_precision=precision or "fp32")
        mode = _Matmuls()
        with mode:
            losses = [pm.step(*batches[0])]
        losses += [pm.step(*b) for b in batches[1:]]
        masters = {p.dtype for p in pm.trained.parameters()}
        states = {t.dtype for s in pm.optimizer.state.values() for t in s.values() if t.is_floating_point()}
        runs[precision] = (losses, mode.dtypes, masters, states, pm.precision.loss_scale)
    return plan.precision, runs


def _fp32(name):
    """The losses of one process training the case's model in fp32 (Adam, as `_train`)."""
    w, batches = _setup(name)
    opt = torch.optim.Adam(w.model.parameters(), lr=1e-3)
    losses = []
    for inputs, target in batches:
        opt.zero_grad()
        loss = w.loss_fn(autopar.first_tensor(w.model(*inputs)), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world, name, layout", [(world, *case) for world, cases in CASES.items() for case in cases])
def test_mixed_precision_trains_as_planned(tmp_path, world, name, layout):
    results = shared_ranks(_train, world, CASES[world], (name, layout), tmp_path)
    if layout == "mismatch":
        mismatch, fp16_compressed = results[0]
        assert mismatch == ("this plan was priced for bf16, the run asks for the model's own dtype (fp32): "
                            "run it with --mixed-precision bf16, or re-plan with --mixed-precision fp32")
        assert "fp16 scales the loss" in fp16_compressed  # the rule book's words (`contract.compat`)
        return
    fp32 = _fp32(name)
    for priced, runs in results:
        assert priced == "bf16"
        for precision in ("bf16", "fp16"):
            losses, matmuls, masters, states, scale = runs[precision]
            assert losses == pytest.approx(fp32, rel=TOLERANCE[precision]), precision
            assert losses != fp32  # it did compute in 16 bits
            assert matmuls <= {PRECISIONS[precision]}, matmuls
            assert masters == {torch.float32} and states <= {torch.float32}
            assert scale > 1 if precision == "fp16" else scale == 1
