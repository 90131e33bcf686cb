"""Model families `transformers` ships, built from small configs (no downloads), as workloads.

Each family is one line of `FAMILIES`: a config class, a model class, the config's fields and the
task that says what a batch is and which loss trains it. Dropout is off (ranks would draw other
masks than one process) and every model runs in float32.
"""

from __future__ import annotations

import torch
from torch import nn

import autopar

BATCH, SEQ, VOCAB = 8, 16, 128

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
_ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)

# name: (config class, model class, config fields, task)
FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                                    bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0), "causal"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER, "causal"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER, "causal"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "router_jitter_noise": 0.0}, "causal"),
    "bert": ("BertConfig", "BertForMaskedLM", _ENCODER, "masked"),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(_ENCODER, image_size=16, patch_size=4, num_channels=3,
                                                            num_labels=10), "image"),
    # keyword inputs (input_ids, decoder_input_ids), the attention mask between them left at None
    "t5-keywords": ("T5Config", "T5ForConditionalGeneration", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                                   num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
                                                                   dropout_rate=0.0, decoder_start_token_id=0),
                    "seq2seq-keywords"),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
                                                          dropout_rate=0.0, decoder_start_token_id=0), "seq2seq"),
}


def _causal(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    return (ids[:, :-1],), ids[:, 1:]


def _masked(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[batch // 2:, SEQ - 4:] = 0  # padded samples: the attention mask matters
    return (ids, mask), torch.randint(0, VOCAB, (batch, SEQ), generator=gen)


def _image(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    return (torch.randn(batch, 3, 16, 16, generator=gen),), torch.randint(0, 10, (batch,), generator=gen)


def _seq2seq(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[batch // 2:, SEQ - 4:] = 0
    labels = torch.randint(0, VOCAB, (batch, SEQ // 2 + 1), generator=gen)
    return (ids, mask, labels[:, :-1]), labels[:, 1:]  # forward(input_ids, attention_mask, decoder_input_ids)


def _seq2seq_keywords(batch: int, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    (ids, _, decoder_ids), target = _seq2seq(batch, gen)
    return {"input_ids": ids, "decoder_input_ids": decoder_ids}, target


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


TASKS = {"causal": _causal, "masked": _masked, "image": _image, "seq2seq": _seq2seq,
         "seq2seq-keywords": _seq2seq_keywords}


def workload(name: str, batch: int = BATCH) -> autopar.Workload:
    """The family's model (seeded by the caller) with a batch maker and the loss of its task.

    The loss receives the logits under every layout (`autopar.parallelize`'s loss contract)."""
    import transformers

    config_cls, model_cls, fields, task = FAMILIES[name]
    config = getattr(transformers, config_cls)(**fields)
    config._attn_implementation = "eager" if task.startswith("seq2seq") else "sdpa"
    model = getattr(transformers, model_cls)(config).float()
    make_batch = TASKS[task]
    return autopar.Workload(f"hf-{name}", model, make_batch(batch, torch.Generator())[0], batch,
                            _token_loss if task != "image" else nn.functional.cross_entropy, make_batch)
