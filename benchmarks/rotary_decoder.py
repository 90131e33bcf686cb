"""A Llama decoder (rotary embeddings, RMSNorm, SwiGLU) the size of the zoo's gpt-small, from a
`transformers` config: the second model of the measured-memory benchmark.

    python benchmarks/memory_truth.py --model benchmarks/rotary_decoder.py:llama_small
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH = 8192, 128, 16


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    return (tokens[:, :-1],), tokens[:, 1:]


def llama_tiny():
    """gpt-tiny's size (hidden 64, 2 layers, 4 heads, 32 tokens, batch 8): shapes at which compute is
    negligible and the host's time per op is what a step takes (`benchmarks/host_overhead.py`)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (8, 33), generator=gen)

    def batch(size: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
        t = torch.randint(0, 512, (size, 33), generator=gen)
        return (t[:, :-1],), t[:, 1:]
    return model, (tokens[:, :-1],), _loss, batch


def llama_small():
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    return model, _batch(BATCH, torch.Generator().manual_seed(0))[0], _loss, _batch
