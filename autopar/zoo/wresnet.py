"""Wide-ResNet as in Alpa's suite: ResNet-50/101 bottlenecks, base channels C, 3×3 convs W× wider.

Stage i has channels C·2^i; a bottleneck is 1×1 (C·2^i) → 3×3 (C·2^i·W, strided) → 1×1 (4·C·2^i),
BatchNorm after each, a projection when the shape changes; 1024 classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


@dataclass(frozen=True, kw_only=True)
class WResNetConfig:
    stages: tuple[int, ...]
    channels: int
    width: int
    image: int = 224
    classes: int = 1024


class Bottleneck(nn.Module):
    def __init__(self, cin: int, filters: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, filters, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(filters)
        self.conv2 = nn.Conv2d(filters, filters * width, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(filters * width)
        self.conv3 = nn.Conv2d(filters * width, filters * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(filters * 4)
        self.proj = None
        if stride != 1 or cin != filters * 4:
            self.proj = nn.Sequential(nn.Conv2d(cin, filters * 4, 1, stride, bias=False), nn.BatchNorm2d(filters * 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (self.proj(x) if self.proj is not None else x))


class WideResNet(nn.Module):
    def __init__(self, cfg: WResNetConfig) -> None:
        super().__init__()
        c = cfg.channels
        self.stem = nn.Sequential(nn.Conv2d(3, c, 7, 2, padding=3, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1))
        blocks, cin = [], c
        for i, n in enumerate(cfg.stages):
            for j in range(n):
                blocks.append(Bottleneck(cin, c * 2**i, cfg.width, 2 if i > 0 and j == 0 else 1))
                cin = c * 2**i * 4
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


def build(cfg: WResNetConfig) -> WideResNet:
    return WideResNet(cfg)


def example_inputs(cfg: WResNetConfig, batch: int, device: torch.device | str) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, 3, cfg.image, cfg.image, device=device),)


def make_batch(cfg: WResNetConfig, batch: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    images = torch.randn(batch, 3, cfg.image, cfg.image, generator=generator)
    return (images,), torch.randint(0, cfg.classes, (batch,), generator=generator)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)
