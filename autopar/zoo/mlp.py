"""A plain MLP classifier: the smallest model every parallelism applies to."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    dims: tuple[int, ...]  # input, hidden..., classes


class MLPBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.fc = nn.Linear(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        d = cfg.dims
        self.layers = nn.ModuleList(MLPBlock(a, b) for a, b in zip(d[:-2], d[1:-1]))
        self.head = nn.Linear(d[-2], d[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(cfg: MLPConfig) -> MLP:
    return MLP(cfg)


def example_inputs(cfg: MLPConfig, batch: int, device: torch.device | str) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, cfg.dims[0], device=device),)


def make_batch(cfg: MLPConfig, batch: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    x = torch.randn(batch, cfg.dims[0], generator=generator)
    return (x,), torch.randint(0, cfg.dims[-1], (batch,), generator=generator)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)
