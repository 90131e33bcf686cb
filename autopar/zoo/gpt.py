"""GPT in Megatron-LM's form: pre-LayerNorm blocks, learned positions, tied input/output embedding.

Per layer: Q, K, V and output projections (4h² + 4h), MLP h→4h→h (8h² + 5h), two LayerNorms (4h):
12h² + 13h. With the embeddings, (V + s)·h. That is Megatron's parameter formula
`12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`, plus the final LayerNorm's 2h, which the formula leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int
    seq: int
    hidden: int
    layers: int
    heads: int
    ffn_mult: int = 4
    # False: attention as Megatron-LM ran it before fused kernels (QKᵀ/√d, causal mask, softmax, the
    # product with V, each kept for backward: the s² activations selective recomputation frees)
    fused_attention: bool = True

    def megatron_params(self) -> int:
        """Megatron-LM's parameter count (no final LayerNorm)."""
        l, h = self.layers, self.hidden
        return 12 * l * h * h + 13 * l * h + (self.vocab + self.seq) * h


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads, self.fused = cfg.heads, cfg.fused_attention
        # Separate Q, K, V projections (Megatron fuses them with a per-head interleaved layout):
        # column-parallel sharding then splits heads without re-laying out a fused weight.
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.fc2 = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, blocks: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.h = nn.ModuleList(blocks if blocks is not None else [Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in Megatron-LM
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron's init: N(0, 0.02), output projections scaled by 1/sqrt(2·layers)."""
        for name, m in self.named_modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                scaled = name.endswith(("proj", "fc2"))
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * self.cfg.layers) if scaled else 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(cfg: GPTConfig) -> GPT:
    return GPT(cfg)


def example_inputs(cfg: GPTConfig, batch: int, device: torch.device | str) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, cfg.seq, dtype=torch.long, device=device),)


def make_batch(cfg: GPTConfig, batch: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Synthetic next-token data: random tokens, targets shifted by one."""
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
