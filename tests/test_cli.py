"""The `autopar` command line: JSON for scripts, tables for people, one message for bad input."""

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopar import load_workload
from autopar.cli import main
from autopar.contract.placements import Replicate, Shard
from autopar.cost_models.presets import A100_DGX
from autopar.runtime.backend import rank_cores
from autopar.runtime.memory import CATEGORIES
from autopar.zoo import ZOO

R = Replicate()


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_gpt_1_3b_matches_formula_and_flop_counter(capsys):
    report = run_json(capsys, "inspect", "gpt-1.3b", "--batch", "8")
    cfg = ZOO["gpt-1.3b"].config
    l, h, v, s = cfg.layers, cfg.hidden, cfg.vocab, cfg.seq
    megatron = 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    # Megatron's formula has no final LayerNorm; the model (like Megatron-LM's code) has one: 2h more
    assert report["num_params"] == round(megatron) + 2 * h
    w = load_workload("gpt-1.3b", batch=8)
    with FlopCounterMode(display=False) as counter:
        w.model(*w.example_inputs)
    assert report["flops_forward"] == pytest.approx(counter.get_total_flops(), rel=0.01)
    assert report["model"] == "gpt-1.3b" and report["batch"] == 8 and report["dtype"] == "float16"
    assert report["param_bytes"] == 2 * report["num_params"]
    assert report["num_nodes"] > 24 * 20 and report["capture_time_s"] > 0
    layers = report["layers"]
    assert [layer["name"] for layer in layers[2:26]] == [f"h.{i}" for i in range(24)]
    assert {"index", "name", "flops_forward", "param_bytes", "activation_bytes"} <= set(layers[0])
    assert sum(layer["flops_forward"] for layer in layers) == pytest.approx(report["flops_forward"])


def test_inspect_table(capsys):
    assert main(["inspect", "gpt-tiny"]) == 0
    out = capsys.readouterr().out
    assert "h.0" in out and "lm_head" in out and "total" in out and "134,912 parameters" in out


def test_clusters(capsys):
    report = run_json(capsys, "clusters")
    assert [c["name"] for c in report["clusters"]] == ["v100-p3", "a100-dgx", "h100-dgx", "cpu-local"]
    assert main(["clusters"]) == 0
    assert "V100-SXM2-16GB" in capsys.readouterr().out


UNCAPTURABLE = textwrap.dedent('''
    import torch
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x
    def make():
        return Branchy(), (torch.randn(2, 4),)
''')


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "gpt-13b"], "unknown model 'gpt-13b'"),
        (["inspect", "no_such_pkg.mod:make"], "cannot import no_such_pkg.mod"),
        (["inspect", "{tmp}/branchy.py:make"], "cannot capture Branchy with torch.export: Tensor.__bool__ needs the value of a tensor"),
        (["clusters", "{tmp}/cluster.json"], "is not valid JSON"),
        (["inspect", "gpt-tiny", "--batch", "-2"], "--batch must be a positive integer"),
        (["plan", "gpt-tiny", "--mesh", "8"], "malformed mesh '8'"),
        (["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x16"], "at most 8 devices per host"),
        (["plan", "gpt-tiny", "--mesh", "1x2", "--stages", "9"], "--stages 9: gpt-tiny has 6 layers and the mesh 2 devices"),
        (["plan", "gpt-tiny", "--cluster", "v100-p3", "--mesh", "1x2", "--memory-limit", "0.0001"],
         "fits on no layout of 1x2 v100-p3: even spread over every device"),
        (["plan", "gpt-tiny", "--cluster", "v100-p3", "--mesh", "1x4", "--manual", "2,2"], "malformed layout '2,2'"),
        (["plan", "gpt-tiny", "--cluster", "v100-p3", "--mesh", "1x4", "--manual", "1,1,4"],
         "2 blocks do not split evenly into 4 stages"),
        (["show", "{tmp}/cluster.json"], "is not valid JSON"),
        (["plan", "gpt-tiny", "--cluster", "nope", "--mesh", "1x4"], "unknown cluster 'nope': presets are"),
        (["plan", "gpt-tiny", "--mesh", "1x2", "--time-limit", "0"], "--time-limit must be a positive number, got 0"),
        (["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--manual", "4,1,1", "--batch", "6"],
         "data parallelism 4 does not divide the batch 6"),
        (["train", "gpt-tiny", "--nproc", "2", "--plan", "{tmp}/absent.json"], "plan file {tmp}/absent.json does not exist"),
        (["plan", "gpt-tiny", "--mesh", "1x2", "--sequence-parallel"], "--sequence-parallel lays out a --manual layout"),
        (["plan", "gpt-tiny", "--mesh", "1x2", "--manual", "2,1,1+sp"], "sequence parallelism splits the sequence over "
                                                                         "the tensor axis: it needs a tensor axis of 2 or more"),
    ],
)
def test_bad_input_is_one_message_without_traceback(argv, message, tmp_path, capsys):
    """In this process through `main` (a new interpreter per case cost 5 s on 2 cores; the entry
    point's own handling is `test_hostile`'s), and `train` as a user launches it."""
    (tmp_path / "branchy.py").write_text(UNCAPTURABLE)
    (tmp_path / "cluster.json").write_text("{")
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] == "train":
        proc = subprocess.run([sys.executable, "-m", "autopar", *argv], capture_output=True, text=True, timeout=300)
        code, err = proc.returncode, proc.stderr
    else:
        code, err = main(argv), capsys.readouterr().err
    assert code == 2
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err
    if "branchy" in argv[1]:
        assert "branchy.py:5" in err  # points at the user's line


def test_plan_json_out_file_and_show(capsys, tmp_path):
    out = tmp_path / "plan.json"
    plan = run_json(capsys, "plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--out", str(out))
    saved = json.loads(out.read_text())
    assert saved == {k: v for k, v in plan.items() if k != "planning_time_s"} and plan["planning_time_s"] > 0
    assert saved["schema"] == "autopar.plan/4"
    stage = saved["stages"][0]
    assert stage["layers"][0] == 0 and saved["stages"][-1]["layers"][1] == len(saved["layers"])
    assert sum(s["submesh"][0] * s["submesh"][1] for s in saved["stages"]) == 4
    names = {name for name, _ in load_workload("gpt-tiny").model.named_parameters()}
    assert set().union(*(s["params"] for s in saved["stages"])) == names
    assert {"step_time_s", "tflops_per_device", "peak_memory_bytes", "bubble_fraction"} <= set(saved["estimate"])
    assert run_json(capsys, "show", str(out)) == saved
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "auto plan for gpt-tiny" in text and "stage 0" in text


def test_plan_is_deterministic(capsys, tmp_path):
    for name in ("a.json", "b.json"):
        assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--out", str(tmp_path / name)]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_manual_layout_with_sequence_parallelism(capsys):
    """Megatron-LM's --sequence-parallel: the norms split the sequence on the tensor axis, and each
    rank keeps a tp-th of their activations (the layout's memory prices it)."""
    args = ["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--manual", "1,4,1,1"]
    megatron, sp = run_json(capsys, *args), run_json(capsys, *args, "--sequence-parallel")
    assert sp["name"] == "megatron-1,4,1,1+sp" and run_json(capsys, *args[:-1], "1,4,1,1+sp")["name"] == sp["name"]
    norms = [n for n, p in sp["stages"][0]["ops"].items() if n.startswith("layer_norm")]
    assert norms and all(sp["stages"][0]["ops"][n] == ["R", "S(1)"] for n in norms)
    assert all(megatron["stages"][0]["ops"][n] == ["R", "R"] for n in norms)
    assert (sp["stages"][0]["cost"]["activation_bytes_per_microbatch"]
            < megatron["stages"][0]["cost"]["activation_bytes_per_microbatch"])


def test_manual_layout_with_zero_1_2_and_3(capsys):
    """--zero 1/2 (or DP,TP,PP+z1): the stage's optimizer states (and gradients) sharded over dp,
    priced as FSDP2 runs them; +z3 shards the weights too; bad combinations are refused with what
    to do instead."""
    args = ["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--manual"]
    plain, z1, z2 = (run_json(capsys, *args, text) for text in ("4,1,1,2", "4,1,1,2+z1", "4,1,1,2+z2"))
    assert run_json(capsys, *args, "4,1,1,2", "--zero", "1")["name"] == z1["name"] == "megatron-4,1,1,2+z1"
    assert "zero" not in plain["stages"][0] and z1["stages"][0]["zero"] == 1 and z2["stages"][0]["zero"] == 2
    assert z1["dp_gradient"]["zero_stage"] == 1
    states = [p["stages"][0]["cost"]["state_bytes"] for p in (plain, z1, z2)]
    assert states[0] > states[1] > states[2]
    grads = [p["stages"][0]["cost"]["grad_bytes"] for p in (plain, z1, z2)]
    # the gradients the first backward allocates: none plain (the synchroniser's bucket views are held
    # from the step's start), all under ZeRO-1 (FSDP2's), a quarter of them sharded under ZeRO-2
    assert grads[0] == 0 and grads[1] > 0 and grads[1] == pytest.approx(4 * grads[2])
    # ZeRO-2 reduce-scatters every microbatch's gradients: each but the last adds FSDP2's copy of
    # them into the collective's input and the sum into the shard (memory traffic), beside the collective
    bandwidth = A100_DGX.device.memory_bandwidth
    copies = (2 * grads[1] + 3 * grads[2]) / bandwidth / 2  # per microbatch, 1 of 2 microbatches
    assert z2["stages"][0]["cost"]["backward_s"] - z1["stages"][0]["cost"]["backward_s"] >= copies * (1 - 1e-9)
    z3 = run_json(capsys, *args, "4,1,1,2+z3")
    assert z3["name"] == "megatron-4,1,1,2+z3" and z3["dp_gradient"]["zero_stage"] == 3
    assert all(p[0] == "S(0)" for p in z3["stages"][0]["params"].values())
    assert z3["stages"][0]["cost"]["state_bytes"] < states[2] and z3["stages"][0]["cost"]["grad_bytes"] < grads[1]
    for bad, why in (("1,4,1+z1", "it needs a data axis of 2 or more"), ("2,1,2+z2", "one-stage"),
                     ("4,1,1+z1+z3", "malformed"), ("4,1,1+z3+offload", "it needs ZeRO-1 or ZeRO-2 on the stage")):
        assert main([*args, bad]) == 2
        assert why in capsys.readouterr().err


def test_offloading_the_zero_shards_to_host_memory(capsys):
    """+offload (--offload): ZeRO's shards (fp32 weights, gradients, Adam's moments) leave the device,
    priced with the host link and the host's memory bandwidth; the free search takes it when the
    memory binds; a cluster whose devices are the host prices no saving; without ZeRO it is refused."""
    args = ["plan", "gpt-2.6b", "--cluster", "v100-p3", "--mesh", "1x8", "--manual"]
    z1, off = (run_json(capsys, *args, text) for text in ("8,1,1+z1", "8,1,1+z1+offload"))
    assert run_json(capsys, *args, "8,1,1", "--zero", "1", "--offload")["name"] == off["name"] \
        == "megatron-8,1,1+z1+offload"
    assert off["stages"][0]["offload"] is True and "offload" not in z1["stages"][0]
    saved = z1["stages"][0]["cost"]["state_bytes"] - off["stages"][0]["cost"]["state_bytes"]
    assert saved > 0 and off["estimate"]["peak_memory_bytes"] < z1["estimate"]["peak_memory_bytes"]
    assert off["estimate"]["step_time_s"] > z1["estimate"]["step_time_s"]  # copies and the host's slower step
    assert z1["estimate"]["fits"] is False and off["estimate"]["fits"] is True  # 16 GB V100s
    free = ["plan", "gpt-2.6b", "--cluster", "v100-p3", "--mesh", "1x8"]
    assert "offload" not in run_json(capsys, *free)["stages"][0]  # ZeRO-2 fits: faster on the device
    bound = run_json(capsys, *free, "--memory-limit", "9")
    assert bound["estimate"]["fits"] and bound["stages"][0]["offload"] is True
    local = ["plan", "gpt-tiny", "--cluster", "cpu-local", "--mesh", "1x2", "--manual"]
    a, b = (run_json(capsys, *local, text) for text in ("2,1,1,2+z1", "2,1,1,2+z1+offload"))
    assert a["estimate"]["step_time_s"] == b["estimate"]["step_time_s"] and b["stages"][0]["offload"] is True
    assert main([*args, "8,1,1+offload"]) == 2
    assert "add +z1 or +z2" in capsys.readouterr().err


def test_manual_layout_and_compare(capsys):
    plan = run_json(capsys, "plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--manual", "2,1,2,4")
    assert plan["name"] == "megatron-2,1,2,4" and plan["num_microbatches"] == 4 and len(plan["stages"]) == 2
    assert all(s["logical_mesh"] == [2, 1] for s in plan["stages"])
    result = run_json(capsys, "compare", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4")
    assert {"step_time_s", "tflops_per_device", "peak_memory_bytes", "fits"} <= set(result["auto"])
    names = {m["name"] for m in result["manual"]}
    assert {"megatron-4,1,1", "megatron-1,4,1", "megatron-2,2,1", "megatron-2,1,2"} <= names
    for m in result["manual"]:
        assert m["dp"] * m["tp"] * m["pp"] == 4
        assert {"num_microbatches", "step_time_s", "tflops_per_device", "peak_memory_bytes", "fits"} <= set(m)
    best_manual = min(m["step_time_s"] for m in result["manual"] if m["fits"])
    assert result["auto"]["step_time_s"] <= best_manual * (1 + 1e-9)  # by construction (`planner.auto`)
    assert result["auto"]["found_by"] in {"stage DP"} | names


def test_compare_lists_the_deepspeed_moe_layout_for_moe_models(capsys):
    from autopar.cost_models import get_cluster
    from autopar.planner.manual import deepspeed_moe_plan, has_experts
    from autopar.planner.search import Search

    result = run_json(capsys, "compare", "moe-tiny", "--cluster", "v100-p3", "--mesh", "1x4", "--batch", "16")
    ds = next(m for m in result["manual"] if m["name"] == "deepspeed-moe")
    assert (ds["dp"], ds["tp"], ds["pp"]) == (4, 1, 1)
    assert result["auto"]["step_time_s"] <= ds["step_time_s"] * 1.0001
    gpt = run_json(capsys, "compare", "gpt-tiny", "--cluster", "v100-p3", "--mesh", "1x4")
    assert all(m["name"] != "deepspeed-moe" for m in gpt["manual"])  # dense models have no experts

    search = Search.start(load_workload("moe-tiny", batch=16), get_cluster("v100-p3"), (1, 4))
    assert has_experts(search)
    plan = deepspeed_moe_plan(search)
    (stage,) = plan.stages
    assert stage.logical_mesh == (1, 4)  # every device a data-parallel rank
    experts = {f: p for f, p in stage.params.items() if f.endswith(("mlp.wi", "mlp.wo"))}
    assert experts and all(p == [R, Shard(0)] for p in experts.values())  # spread over all devices
    assert all(p == [R, R] for f, p in stage.params.items() if f not in experts)  # dense: replicated
    ops = {n: search.graph.node(n).op for n in stage.ops}
    assert all(stage.ops[n][1] != R for n, op in ops.items() if op == "aten.linear.default")  # batch split
    # ZeRO-2: dense weights keep a quarter of their gradients and optimizer state
    dense = sum(search.graph.params[f].nbytes for f in stage.params if f not in experts)
    assert stage.cost["state_bytes"] < 4 * dense  # replicated fp32 Adam states would be 4 × params


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p.update(schema="autopar.plan/0"), "schema 'autopar.plan/0'"),
    (lambda p: p["stages"][0].update(recompute="false"), "recompute must be true or false"),
    (lambda p: p.update(mesh=[1, 8]), "the stages use 4 devices, the mesh 1x8 has 8"),
    (lambda p: p["estimate"].pop("fits"), "estimate must have exactly"),
    (lambda p: p["dp_gradient"].update(zero_stage=7), "zero_stage must be 0, 1, 2 or 3"),
    (lambda p: p["stages"][0].update(offload=True), "offload moves the states ZeRO-1/2 shard to host memory"),
    (lambda p: p["layers"].__setitem__(0, "wte"), "layers[0] must be"),
    (lambda p: p.update(num_microbatches=3), "num_microbatches 3 must be at least 1 and divide the batch 8"),
    (lambda p: p["stages"][0]["params"].__setitem__("wte.weight", ["R", "X"]), "two placements"),
    (lambda p: p["stages"][0]["needs"].__setitem__("linear", ["S(x)"]), "needs['linear'] must be a list of placements"),
    (lambda p: p["stages"][0].update(collectives=[{"kind": "all_reduce", "phase": "forward", "bytes": -1}]),
     "collectives must be objects with node, kind and phase"),
])
def test_malformed_plans_are_explained(capsys, tmp_path, mutate, message):
    from autopar.contract.plan import Plan, PlanError

    path = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    mutate(data)
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan.from_json(json.dumps(data))


def test_a_tensor_parallel_plan_round_trips_with_what_each_op_needs(capsys, tmp_path):
    from autopar.contract.plan import Plan

    path = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x2", "--manual", "1,2,1", "--out", str(path)]) == 0
    plan = Plan.load(path)
    needs = plan.stages[0].needs
    assert needs and set(needs) <= set(plan.stages[0].ops)  # every op of the tensor-parallel stage
    assert needs["embedding"] == [Shard(0), R]  # vocabulary-parallel: the weight split, the indices whole
    # what the stage's program will issue, as priced: the tensor axis's, forward and backward
    assert {(c["kind"], c["phase"]) for c in plan.stages[0].collectives} >= {("all_reduce", "forward"),
                                                                           ("all_reduce", "backward")}
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json() == path.read_text()
    capsys.readouterr()
    assert main(["show", str(path)]) == 0  # no model to lower: what the plan says its program issues
    assert "tensor-axis collectives each stage's program issues" in capsys.readouterr().out


def test_placements_written_as_text_are_typed_before_the_runtime_sees_them(tmp_path):
    """A plan edited in Python with the file's spelling ("S(0)") runs as the typed plan would:
    the check every run makes types them, or names what is not a placement."""
    from autopar.contract.plan import Plan, PlanError
    from autopar.planner.capture import capture

    w = load_workload("gpt-tiny", batch=8)
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x2", "--manual", "2,1,1", "--out", str(path)]) == 0
    plan = Plan.load(path)
    graph = capture(w.model, w.example_inputs)
    shapes = {n: tuple(p.shape) for n, p in w.model.named_parameters(remove_duplicate=False)}
    stage = plan.stages[0]
    stage.params = {f: ["S(0)", str(p[1])] for f, p in stage.params.items()}
    plan.check_placements(graph, shapes)
    assert all(p == [Shard(0), R] for p in stage.params.values())
    stage.params = {f: ["S(0)", "X"] for f in stage.params}
    with pytest.raises(PlanError, match="not a placement: 'X'"):
        plan.check_placements(graph, shapes)



def test_json_stdout_survives_native_code_printing_to_it(capfd, monkeypatch):
    import os

    import autopar.cli as cli

    real = cli.cmd_clusters

    def noisy(args, out):
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")  # as HiGHS does
        return real(args, out)

    monkeypatch.setattr(cli, "cmd_clusters", noisy)
    assert main(["clusters", "--json"]) == 0
    captured = capfd.readouterr()
    assert json.loads(captured.out)["clusters"] and "HighsMip" in captured.err


def test_train_on_two_ranks_follows_the_one_rank_losses(capsys):
    two = run_json(capsys, "train", "gpt-tiny", "--nproc", "2", "--plan", "2,1,1,2", "--steps", "2")
    one = run_json(capsys, "train", "gpt-tiny", "--nproc", "1", "--plan", "1,1,1", "--steps", "2")
    assert len(two["losses"]) == 2 and two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["step_time_s"] > 0 and two["samples_per_s"] == pytest.approx(8 / two["step_time_s"])
    assert len(two["peak_rss_bytes"]) == 2 and min(two["peak_rss_bytes"]) > 0
    for measured in two["peak_tensor_bytes"]:  # the last step's live tensors, by the planner's categories
        assert measured["total"] == sum(measured[c] for c in CATEGORIES)
        # each gradient held once: in the synchroniser's bucket, whose last one also carries the
        # step's loss (one fp32 scalar) to its all-reduce
        assert measured["gradients"] - measured["parameters"] in (0, 4) and measured["gradients"] > 0
        assert measured["activations"] > 0
        moments = 2 * measured["parameters"]  # AdamW's two moments and a step count per parameter
        assert moments < measured["optimizer"] < moments + 1024
    tp = run_json(capsys, "train", "gpt-tiny", "--nproc", "2", "--plan", "1,2,1", "--steps", "2")
    assert tp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert main(["train", "gpt-tiny", "--nproc", "2", "--plan", "1,4,1", "--steps", "1"]) == 2
    assert "--plan 1,4,1: dp × tp × pp = 4, the job has 2 ranks: pass --nproc 4" in capsys.readouterr().err


def test_plan_compression_auto_compresses_only_over_slow_links(capsys, tmp_path):
    """On NVLink/InfiniBand (a100-dgx) dense averaging hides under backward: no compressor. With the
    same hosts joined by 1 Gb/s, the data axis crosses hosts through a compressor."""
    from autopar.cost_models import get_cluster
    from autopar.cost_models.compression import auto_candidates

    slow = get_cluster("a100-dgx").to_dict()
    slow.update(name="a100-1gbe", description="A100 hosts joined by 1 Gb/s Ethernet")
    slow["inter_host"]["bandwidth"] = 125e6
    path = tmp_path / "a100-1gbe.json"
    path.write_text(json.dumps(slow))
    fast_plan = run_json(capsys, "plan", "gpt-small", "--cluster", "a100-dgx", "--mesh", "2x1", "--compression", "auto")
    slow_plan = run_json(capsys, "plan", "gpt-small", "--cluster", str(path), "--mesh", "2x1", "--compression", "auto")
    assert fast_plan["dp_gradient"]["compression"] is None
    assert slow_plan["dp_gradient"]["compression"] is not None
    assert slow_plan["stages"][0]["logical_mesh"][0] == 2  # the data axis crosses the slow link
    weighed = slow_plan["search"]["compression"]
    # dense and the methods that held in the convergence sweep (its verdict ships with the package)
    assert set(weighed) == {text or "none" for text in auto_candidates()} and len(weighed) > 1
    assert weighed[slow_plan["dp_gradient"]["compression"].split(",")[0]] < weighed["none"]


def test_train_with_a_compressor_reports_compressed_bytes(capsys, tmp_path):
    from tests.test_compression import slow_link

    result = run_json(capsys, "train", "mlp-tiny", "--nproc", "2", "--plan", "2,1,1", "--steps", "2",
                      "--cluster", slow_link(tmp_path, 2), "--compression", "powersgd:2,start=0,min_size=0")
    assert result["compression"] == "powersgd:2,min_rate=2,min_size=0,start=0"  # every default written out
    assert 0 < result["comm"]["dp"]["bytes_sent"] < result["comm"]["dp"]["bytes_raw"] / 4


def test_show_draws_the_schedule_devices_and_memory_of_a_4_stage_1f1b_plan(capsys, tmp_path):
    from autopar.contract.plan import Plan
    from autopar.draw import COLOURS, draw

    path, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "gpt-1.3b", "--cluster", "v100-p3", "--mesh", "1x4", "--batch", "32",
                 "--manual", "1,1,4,8", "--out", str(path)]) == 0
    capsys.readouterr()
    shown = run_json(capsys, "show", str(path), "--png", str(png))
    assert shown["png"] == str(png) and png.stat().st_size > 20_000
    fig = draw(Plan.load(path), memory_limit=15e9)
    gantt, devices, memory = fig.axes
    bars = [p for p in gantt.patches if abs(p.get_height() - 0.6) < 1e-9]  # compute bars: one per (stage, microbatch, F/B)
    assert len(bars) == 4 * 8 * 2
    assert {tuple(round(c, 3) for c in p.get_facecolor()[:3]) for p in bars} == {
        tuple(round(int(COLOURS[k][i:i + 2], 16) / 255, 3) for i in (1, 3, 5)) for k in ("F", "B")}
    assert len(devices.patches) == 4 and len(memory.patches) == 8  # 4 devices; states + activations per stage
    assert [t.get_text() for t in gantt.get_yticklabels()][0].startswith("stage 0")


def test_calibrate_writes_a_cluster_the_planner_reads(capsys, tmp_path):
    from autopar.cost_models import get_cluster

    path = tmp_path / "cluster.json"
    result = run_json(capsys, "calibrate", "--nproc", "2", "--out", str(path), "--repeats", "2")
    spec = get_cluster(str(path))
    # two starts of the ranks, each rank on a core of its own where there are two; each term's spread
    assert result["repeats"] == 2 and result["pinned"] == rank_cores(2)
    assert result["terms"]["matmul float32 FLOP/s"]["value"] == spec.device.peak_flops["float32"]
    assert all(t["spread"] >= 0 for t in result["terms"].values())
    assert spec.devices_per_host == 2 and spec.device.peak_flops["float32"] > 1e8
    assert spec.intra_host.latency > 0 and spec.intra_host.bandwidth > 1e6
    assert {(r["ranks"], r["collective"]) for r in result["collectives"]} == {
        (2, "all_reduce"), (2, "all_gather"), (2, "reduce_scatter")}
    # all-gathers and reduce-scatters as measured: the ring formula's time × the link's factor
    assert spec.intra_host.gather_factor > 0 and spec.intra_host.scatter_factor > 0
    assert all(r["measured_s"] > 0 and r["fitted_s"] > 0 for r in result["collectives"])
    # the terms beside FLOPs and bytes: per op, in a lowered sharded stage, on DTensors, the optimizer,
    # cores, overlap; the runtime measured as it runs and as a stage left to the interpreter runs
    assert 0 < spec.device.op_overhead_s < 1e-3 and spec.device.sharded_op_overhead_s >= 0
    assert 0 <= spec.device.lowered_op_overhead_s < 1e-3
    assert {"dp", "tp", "tp_interpreted"} <= set(result["runtime"])
    assert spec.device.optimizer_ops > 0 and spec.device.optimizer_bytes > 0
    # each compressor's own work as the runtime runs it: per unit encoded, per element
    assert set(spec.device.compressor_s) == {"fp16", "randk", "powersgd", "topk", "dgc", "onebit", "terngrad", "qsgd",
                                             "signsgd"}
    assert all(0 < a < 0.1 and 0 <= b < 1e-6 for a, b in spec.device.compressor_s.values())
    assert 1 <= spec.cores_per_host <= 2 and 0 <= spec.intra_host.overlap <= 1
    plan = run_json(capsys, "plan", "mlp-tiny", "--cluster", str(path), "--mesh", "1x2")
    assert plan["cluster"] == "cpu-local" and plan["estimate"]["step_time_s"] > 0
    if not torch.cuda.is_available():  # one rank is measured alone on a GPU only
        assert main(["calibrate", "--nproc", "1", "--out", str(path)]) == 2
        assert "use at least 2 (one rank is measured alone on a GPU only)" in capsys.readouterr().err


def test_bench_runs_every_layout_and_ranks_the_predictions(capsys, tmp_path):
    result = run_json(capsys, "bench", "mlp-tiny", "--nproc", "2", "--warmup", "0", "--steps", "1",
                      "--launches", "2", "--breakdown", str(tmp_path))
    names = [r["name"] for r in result["layouts"]]
    assert result["auto_name"] == names[0] == "auto" and len(names) >= 8  # with 1,1,2,1: fewer microbatches than stages
    assert any(name.endswith("+recompute") for name in names)  # recomputing layouts run too
    assert {r["precision"] for r in result["layouts"]} == {"fp32", "bf16"}  # and mixed-precision ones
    assert any(name.endswith(" zero3") for name in names)  # and ZeRO-3 ones
    assert any(name.endswith("+sp") for name in names)  # and sequence-parallel ones
    assert any(name.endswith("+z1") for name in names) and any(name.endswith("+z2") for name in names)  # ZeRO-1/2
    assert any(name.endswith("+z1+offload") and r["offload"] for name, r in zip(names, result["layouts"]))
    assert all(r["predicted_step_time_s"] > 0 and r["measured_step_time_s"] > 0 for r in result["layouts"])
    assert all(r["predicted_peak_bytes"] > 0 and r["measured_peak_bytes"] > 0 for r in result["layouts"])
    assert -1 <= result["spearman"] <= 1 and result["auto_vs_fastest"] >= 1
    # two launches: a layout's time is their median, its spread their range over it; ties counted
    for r in result["layouts"]:
        assert len(r["launch_step_times_s"]) == 2 and r["measured_step_time_s"] == pytest.approx(sum(r["launch_step_times_s"]) / 2)
        assert r["spread"] == pytest.approx((max(r["launch_step_times_s"]) - min(r["launch_step_times_s"])) / r["measured_step_time_s"])
    assert 0 <= result["noise"]["ties"] <= result["noise"]["pairs"] == len(names) * (len(names) - 1) // 2
    assert result["pinned"] == rank_cores(2)
    # --breakdown: one file per layout, measured per rank beside the prediction per stage
    files = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert len(files) == len(names)
    for row in files.values():
        measured, predicted = row["breakdown"]["measured"], row["breakdown"]["predicted"]
        assert len(measured) == 2 and len(predicted) == len(set(row["breakdown"]["stage_of"]))
        for m in measured:  # phases add up to at most the step; ops ran inside forward and backward
            inside = m["forward_s"] + m["backward_s"] + m["pipeline_s"] + m["dp_sync_s"] + m["optimizer_s"]
            assert 0 < inside <= m["step_s"] * 1.001 and m["ops"] > 0 and m["optimizer_ops"] > 0
            assert m["forward_ops_s"] + m["backward_ops_s"] <= m["forward_s"] + m["backward_s"]
    tp = files["megatron-1-2-1-1"]["breakdown"]["measured"]
    assert all(m["tp_comm_s"] > 0 for m in tp)  # DTensor's collectives, timed
    dp = files["megatron-2-1-1-1"]["breakdown"]["measured"]
    assert all(m["dp_launch_s"] + m["dp_sync_s"] > 0 and m["tp_comm_s"] == 0 for m in dp)
    pp = files["megatron-1-1-2-4"]["breakdown"]
    assert max(m["pipeline_s"] for m in pp["measured"]) > 0 and pp["stage_of"] == [0, 1]


def test_plan_tune_keeps_the_measured_fastest(capsys):
    plan = run_json(capsys, "plan", "mlp-tiny", "--mesh", "1x2", "--tune", "3")
    tuned = plan["search"]["tuned"]
    assert len(tuned) == 3 and len({(t["name"], t["num_microbatches"]) for t in tuned}) == 3
    assert all(t["measured_step_time_s"] > 0 and t["predicted_step_time_s"] > 0 for t in tuned)
    best = min(tuned, key=lambda t: t["measured_step_time_s"])
    assert (plan["name"], plan["num_microbatches"]) == (best["name"], best["num_microbatches"])
    predicted = [t["predicted_step_time_s"] for t in tuned]
    assert predicted == sorted(predicted)  # the best predicted, in order
