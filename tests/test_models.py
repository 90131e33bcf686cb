"""MODEL specs: zoo names, FILE.py:FUNCTION, package.module:FUNCTION, and their errors."""

import textwrap

import pytest
import torch

from autopar import ModelSpecError, load_workload

SPEC = textwrap.dedent('''
    import torch
    def make():
        return torch.nn.Linear(8, 2), (torch.arange(24.).reshape(3, 8),)
    def broken():
        raise RuntimeError("no weights here")
    def wrong():
        return 42
''')


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "mymodel.py"
    path.write_text(SPEC)
    return path


def test_file_spec_and_batch_scaling(spec_file):
    w = load_workload(f"{spec_file}:make")
    assert w.batch == 3 and w.example_inputs[0].shape == (3, 8)
    scaled = load_workload(f"{spec_file}:make", batch=7)
    assert scaled.batch == 7 and scaled.example_inputs[0].shape == (7, 8)
    assert torch.equal(scaled.example_inputs[0][3], w.example_inputs[0][0])  # rows are repeated, not invented


def test_module_spec():
    w = load_workload("tests.specs:tiny_mlp")
    assert isinstance(w.model, torch.nn.Module) and w.loss_fn is not None and w.batch == 4


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gpt-1.3", "did you mean gpt-1.3b"),
        ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
        ("missing.py:f", "no file missing.py"),
    ],
)
def test_bad_specs_are_explained(spec, message):
    with pytest.raises(ModelSpecError, match=message):
        load_workload(spec)


@pytest.mark.parametrize("func, message", [("nope", "has no function 'nope'"), ("broken", "no weights here"),
                                           ("wrong", "must return")])
def test_bad_functions_are_explained(spec_file, func, message):
    with pytest.raises(ModelSpecError, match=message):
        load_workload(f"{spec_file}:{func}")


def test_bad_batch():
    with pytest.raises(ModelSpecError, match="positive"):
        load_workload("gpt-tiny", batch=0)


def test_batch_scaling_keeps_non_batch_inputs(tmp_path):
    path = tmp_path / "biased.py"
    path.write_text(textwrap.dedent('''
        import torch
        class AddBias(torch.nn.Module):
            def forward(self, x, bias):
                return x + bias
        def make():
            return AddBias(), (torch.zeros(3, 8), torch.ones(8))
    '''))
    w = load_workload(f"{path}:make", batch=5)
    assert [tuple(x.shape) for x in w.example_inputs] == [(5, 8), (8,)]


def test_moe_batch_must_fill_expert_groups():
    with pytest.raises(ModelSpecError, match="multiple of 2"):
        load_workload("moe-380m", batch=3)
    assert load_workload("moe-380m", batch=4).batch == 4
