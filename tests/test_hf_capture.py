"""Hugging Face models, which torch.fx.symbolic_trace cannot trace, are captured through torch.export."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopar import capture  # noqa: E402


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), "transformer.h"


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return transformers.LlamaForCausalLM(cfg), "model.layers"


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_model_is_captured(make):
    model, blocks = make()
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)  # the reason capture goes through torch.export
    graph = capture(model, (torch.randint(0, 256, (2, 16)),))
    assert set(graph.params) == {name for name, _ in model.named_parameters()}
    layer_names = [layer.name for layer in graph.layers()]
    assert len(layer_names) == len(set(layer_names))  # each layer is one contiguous run
    assert f"{blocks}.0" in layer_names and f"{blocks}.1" in layer_names and layer_names[-1] == "lm_head"
    assert graph.node(graph.outputs[0]).outputs[0].shape == (2, 16, 256)  # the logits
    linear_flops = sum(n.flops_fwd for n in graph if n.op in ("aten.linear.default", "aten.addmm.default"))
    assert linear_flops > 0 and graph.flops_bwd > graph.flops_fwd


def test_keyword_inputs():
    model, _ = _llama()
    ids = torch.randint(0, 256, (2, 16))
    graph = capture(model, (ids,), {"attention_mask": torch.ones(2, 16, dtype=torch.long)})
    assert [n.name for n in graph if n.op == "input"] == ["input_ids", "attention_mask"]
