"""Hugging Face models, which torch.fx.symbolic_trace cannot trace, are captured through torch.export."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopar.planner.capture import capture


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
    graph = capture(model, {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long)})
    assert [n.name for n in graph if n.op == "input"] == ["input_ids", "attention_mask"]


def test_a_mixture_of_experts_counts_every_tokens_top_k_experts():
    """Mixtral's experts run through transformers' grouped-matmul custom op, which torch's FLOP
    counter does not know: each token's k experts count at their matmul FLOPs, nothing is warned."""
    hidden, inner, layers, experts, k, batch, seq = 32, 64, 2, 4, 2, 4, 16
    cfg = transformers.MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inner,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                     num_local_experts=experts, num_experts_per_tok=k)
    graph = capture(transformers.MixtralForCausalLM(cfg), (torch.randint(0, 256, (batch, seq)),))
    # per token and chosen expert: gate and up (hidden -> 2 inner), down (inner -> hidden)
    by_hand = layers * batch * seq * k * (2 * hidden * 2 * inner + 2 * inner * hidden)
    counted = sum(n.flops_fwd for n in graph if ".experts" in n.module_path)
    assert counted == pytest.approx(by_hand, rel=0.05)
    assert sum(n.flops_bwd for n in graph if ".experts" in n.module_path) == pytest.approx(2 * by_hand, rel=0.05)
    assert graph.warnings == []
