"""Mixture-of-Experts GPT in GShard's form, as in Alpa's MoE suite.

Every other layer's MLP is a mixture of E experts with top-2 gating. Tokens are cut into groups
of `expert_group` tokens; each expert takes at most C = 2·group/E tokens of a group. Dispatch and
combine are dense einsums over static-shape masks (no data-dependent shapes), so the model
captures with `torch.export` and every dimension, experts included, can be sharded. The MLPs are
8h wide, which reproduces the suite's parameter counts (380M … 70B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.contract.errors import ModelSpecError
from autopar.zoo import gpt


@dataclass(frozen=True, kw_only=True)
class MoEConfig(gpt.GPTConfig):
    experts: int
    expert_group: int = 2048
    ffn_mult: int = 8


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        h, f, e = cfg.hidden, cfg.ffn_mult * cfg.hidden, cfg.experts
        self.group = cfg.expert_group
        self.gate = nn.Linear(h, e, bias=False)
        self.wi = nn.Parameter(torch.empty(e, h, f))
        self.wo = nn.Parameter(torch.empty(e, f, h))
        nn.init.normal_(self.wi, std=0.02)
        nn.init.normal_(self.wo, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, m = x.shape
        tokens = x.reshape(-1, min(self.group, b * t), m)  # [G, S, M]
        combine = top2_gating(F.softmax(self.gate(tokens).float(), dim=-1)).to(x.dtype)  # [G, S, E, C]
        dispatch = (combine > 0).to(x.dtype)
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, tokens)
        hidden = F.relu(torch.einsum("egcm,emh->egch", expert_in, self.wi))
        expert_out = torch.einsum("egch,ehm->egcm", hidden, self.wo)
        return torch.einsum("gsec,egcm->gsm", combine, expert_out).reshape(b, t, m)


def _one_hot(index: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """one_hot through a comparison: static shape, no range check on the values."""
    return (index.unsqueeze(-1) == torch.arange(n, device=index.device)).to(dtype)


def top2_gating(gates: torch.Tensor) -> torch.Tensor:
    """GShard's top-2 gating: [G, S, E] gate probabilities -> [G, S, E, C] combine weights."""
    _, s, e = gates.shape
    capacity = max(1, 2 * s // e)
    mask1 = _one_hot(gates.argmax(-1), e, gates.dtype)
    without1 = gates * (1 - mask1)
    mask2 = _one_hot(without1.argmax(-1), e, gates.dtype)
    pos1 = torch.cumsum(mask1, dim=1) - mask1  # position of each token in its expert's buffer
    mask1 = mask1 * (pos1 < capacity)
    pos2 = torch.cumsum(mask2, dim=1) - mask2 + mask1.sum(dim=1, keepdim=True)
    mask2 = mask2 * (pos2 < capacity)
    gate1, gate2 = (gates * mask1).sum(-1), (without1 * mask2).sum(-1)
    denom = (gate1 + gate2).clamp_min(torch.finfo(gates.dtype).eps)
    slot1 = _one_hot((pos1 * mask1).sum(-1).long(), capacity, gates.dtype)  # [G, S, C]
    slot2 = _one_hot((pos2 * mask2).sum(-1).long(), capacity, gates.dtype)
    first = (gate1 / denom)[..., None, None] * mask1[..., None] * slot1[:, :, None, :]
    second = (gate2 / denom)[..., None, None] * mask2[..., None] * slot2[:, :, None, :]
    return first + second


def build(cfg: MoEConfig) -> gpt.GPT:
    blocks = [gpt.Block(cfg, MoE(cfg) if i % 2 == 0 else None) for i in range(cfg.layers)]
    return gpt.GPT(cfg, blocks)


def example_inputs(cfg: MoEConfig, batch: int, device: torch.device | str) -> tuple[torch.Tensor]:
    tokens = batch * cfg.seq
    if tokens > cfg.expert_group and tokens % cfg.expert_group:
        per_group = cfg.expert_group // math.gcd(cfg.expert_group, cfg.seq)
        raise ModelSpecError(
            f"an MoE routes groups of {cfg.expert_group} tokens, so batch × seq ({batch} × {cfg.seq}) must be a "
            f"multiple of {cfg.expert_group}: use a batch that is a multiple of {per_group}"
        )
    return gpt.example_inputs(cfg, batch, device)


make_batch = gpt.make_batch
loss_fn = gpt.loss_fn
