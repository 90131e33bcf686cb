"""One input contract (`autopar.contract.inputs`): a tuple of positional inputs, a dict of keyword
inputs or one tensor, accepted alike by `capture`, `parallelize` and a MODEL function given to the
CLI, refused alike with one message."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.contract.inputs import InputError
from tests.families import workload


def _whisper():
    torch.manual_seed(0)
    w = workload("whisper")
    return w.model, w.example_inputs  # {"input_features": ..., "decoder_input_ids": ...}


def test_capture_takes_keyword_inputs_as_the_model_binds_them():
    model, inputs = _whisper()
    assert set(inputs) == {"input_features", "decoder_input_ids"}
    by_name = autopar.capture(model, inputs)
    # forward(input_features, attention_mask=None, decoder_input_ids, ...): the skipped one at its default
    by_position = autopar.capture(model, (inputs["input_features"], None, inputs["decoder_input_ids"]))
    assert by_name.fingerprint() == by_position.fingerprint()


def test_one_tensor_is_one_positional_input():
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    assert autopar.capture(model, x).fingerprint() == autopar.capture(model, (x,)).fingerprint()


@pytest.mark.parametrize("inputs, message", [
    ({"input_feature": 0}, "example_inputs: the model's forward takes no parameter 'input_feature' by position or "
                           "name; its parameters are input_features, attention_mask, decoder_input_ids"),
    ("input_ids", "example_inputs must be a tuple of positional inputs, a dict of keyword inputs, or one tensor; "
                  "got str"),
])
def test_inputs_outside_the_contract_get_one_message_wherever_they_are_given(tmp_path, inputs, message):
    model, _ = _whisper()
    with pytest.raises(InputError) as capturing:
        autopar.capture(model, inputs)
    assert str(capturing.value).startswith(message)
    with pytest.raises(InputError) as parallelizing:
        autopar.parallelize(model, (1, 1), inputs, loss_fn=torch.nn.functional.cross_entropy,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert str(parallelizing.value) == str(capturing.value)
    (tmp_path / "spec.py").write_text(
        "import torch\nfrom tests.families import workload\n"
        f"def make():\n    torch.manual_seed(0)\n    return workload('whisper').model, {inputs!r}\n")
    with pytest.raises(InputError) as loading:
        autopar.load_workload(f"{tmp_path}/spec.py:make")
    assert str(loading.value) == f"{tmp_path}/spec.py:make: {capturing.value}"


def test_a_model_function_may_return_keyword_inputs(tmp_path):
    (tmp_path / "spec.py").write_text(
        "import torch\nfrom tests.families import workload\n"
        "def make():\n    torch.manual_seed(0)\n    w = workload('whisper')\n    return w.model, w.example_inputs\n")
    w = autopar.load_workload(f"{tmp_path}/spec.py:make")
    assert w.batch == 8 and w.example_inputs[1] is None  # bound by name: the mask between at its default
    assert autopar.capture(w.model, w.example_inputs).fingerprint() == autopar.capture(*_whisper()).fingerprint()


def test_keyword_inputs_may_not_skip_a_parameter_without_a_default():
    class Two(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    with pytest.raises(InputError, match="example_inputs: keyword inputs skip x, which the model's forward needs "
                                         r"\(it has no default\)"):
        autopar.capture(Two(), {"y": torch.randn(2, 3)})
