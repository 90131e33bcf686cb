"""The `autopar` command line: JSON for scripts, tables for people, one message for bad input."""

import json
import subprocess
import sys
import textwrap

import pytest
from torch.utils.flop_counter import FlopCounterMode

from autopar import load_workload
from autopar.cli import main
from autopar.zoo import ZOO


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
        (["inspect", "{tmp}/branchy.py:make"], "cannot capture Branchy"),
        (["clusters", "{tmp}/cluster.json"], "is not valid JSON"),
        (["inspect", "gpt-tiny", "--batch", "-2"], "--batch must be a positive integer"),
        (["plan", "gpt-tiny", "--mesh", "8"], "malformed mesh '8'"),
        (["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x16"], "at most 8 devices per host"),
        (["plan", "gpt-tiny", "--mesh", "1x2", "--stages", "2"], "only --stages 1"),
        (["plan", "gpt-tiny", "--cluster", "v100-p3", "--mesh", "1x2", "--memory-limit", "0.0001"],
         "fits on no logical mesh of 1x2: the leanest sharding needs"),
    ],
)
def test_bad_input_is_one_message_without_traceback(argv, message, tmp_path):
    (tmp_path / "branchy.py").write_text(UNCAPTURABLE)
    (tmp_path / "cluster.json").write_text("{")
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "autopar", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    if "branchy" in argv[1]:
        assert "branchy.py:5" in proc.stderr  # points at the user's line


def test_plan_json_and_out_file(capsys, tmp_path):
    out = tmp_path / "plan.json"
    plan = run_json(capsys, "plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--out", str(out))
    assert json.loads(out.read_text()) == plan
    stage = plan["stages"][0]
    assert stage["submesh"] == [1, 4] and stage["logical_mesh"] in ([4, 1], [2, 2], [1, 4])
    assert set(stage["params"]) == {name for name, _ in load_workload("gpt-tiny").model.named_parameters()}
    assert all(len(p) == 2 and all(x in ("R", "P") or x.startswith("S(") for x in p) for p in stage["params"].values())
    assert stage["solver"]["status"] == "optimal" and stage["cost"]["total_s"] == plan["estimate"]["step_time_s"]
    assert sorted(tuple(c["logical_mesh"]) for c in plan["candidates"]) == [(1, 4), (2, 2), (4, 1)]
    assert plan["planning_time_s"] > 0 and plan["graph_hash"]
    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4"]) == 0
    text = capsys.readouterr().out
    assert "logical mesh" in text and "h.0" in text and "ILP: optimal" in text
