"""Model zoo: the Alpa and Megatron-LM benchmark suites at their published sizes, and tiny
models for tests. Figures from ../shared/REFERENCES.md (Alpa's `benchmark/alpa/suite_*.py`,
Megatron-LM 2021 Table 1)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from autopar.zoo import gpt, mlp, moe, wresnet
from autopar.zoo.gpt import GPTConfig
from autopar.zoo.mlp import MLPConfig
from autopar.zoo.moe import MoEConfig
from autopar.zoo.wresnet import STAGES, WResNetConfig


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: ModuleType  # gpt, moe, wresnet or mlp: build / example_inputs / make_batch / loss_fn
    config: Any
    batch: int  # the suite's default global batch
    dtype: torch.dtype
    source: str


def _gpt(name: str, s: int, h: int, l: int, heads: int, batch: int, source: str, v: int = 51200) -> ZooEntry:
    cfg = GPTConfig(vocab=v, seq=s, hidden=h, layers=l, heads=heads)
    return ZooEntry(name, gpt, cfg, batch, torch.float16, source)


def _moe(name: str, h: int, l: int, e: int) -> ZooEntry:
    cfg = MoEConfig(vocab=32000, seq=1024, hidden=h, layers=l, heads=16, experts=e, expert_group=2048)
    return ZooEntry(name, moe, cfg, 1024, torch.float16, "Alpa MoE suite")


def _wresnet(name: str, depth: int, channels: int, width: int) -> ZooEntry:
    cfg = WResNetConfig(stages=STAGES[depth], channels=channels, width=width)
    return ZooEntry(name, wresnet, cfg, 1536, torch.float32, "Alpa Wide-ResNet suite")


_ALPA = "Alpa GPT suite"
_CPU = "measured runs on CPU"
_MEGATRON = "Megatron-LM 2021 Table 1"
_ENTRIES = [
    _gpt("gpt-350m", 1024, 1024, 24, 16, 1024, _ALPA),
    _gpt("gpt-760m", 1024, 1536, 24, 16, 1024, _ALPA),
    _gpt("gpt-1.3b", 1024, 2048, 24, 32, 1024, _ALPA),
    _gpt("gpt-2.6b", 1024, 2560, 32, 32, 1024, _ALPA),
    _gpt("gpt-6.7b", 1024, 4096, 32, 32, 1024, _ALPA),
    _gpt("gpt-15b", 1024, 5120, 48, 40, 1024, _ALPA),
    _gpt("gpt-39b", 1024, 8192, 48, 64, 1024, _ALPA),
    _gpt("gpt-76b", 1024, 10240, 60, 80, 1024, _ALPA),
    _gpt("gpt3-175b", 2048, 12288, 96, 96, 1536, "GPT-3 (Brown et al. 2020)"),
    _gpt("megatron-1.7b", 2048, 2304, 24, 24, 512, _MEGATRON),
    _gpt("megatron-3.6b", 2048, 3072, 30, 32, 512, _MEGATRON),
    _gpt("megatron-7.5b", 2048, 4096, 36, 32, 512, _MEGATRON),
    _gpt("megatron-18.4b", 2048, 6144, 40, 48, 1024, _MEGATRON),
    _gpt("megatron-39.1b", 2048, 8192, 48, 64, 1536, _MEGATRON),
    _gpt("megatron-76.1b", 2048, 10240, 60, 80, 1792, _MEGATRON),
    _gpt("megatron-145.6b", 2048, 12288, 80, 96, 2304, _MEGATRON),
    _gpt("megatron-310.1b", 2048, 16384, 96, 128, 2160, _MEGATRON),
    _gpt("megatron-529.6b", 2048, 20480, 105, 128, 2520, _MEGATRON),
    _gpt("megatron-1t", 2048, 25600, 128, 160, 3072, _MEGATRON),
    _moe("moe-380m", 768, 8, 8),
    _moe("moe-690m", 768, 8, 16),
    _moe("moe-1.3b", 768, 16, 16),
    _moe("moe-2.4b", 1024, 16, 16),
    _moe("moe-10b", 1536, 16, 32),
    _moe("moe-27b", 2048, 16, 48),
    _moe("moe-70b", 2048, 32, 64),
    _wresnet("wresnet-250m", 50, 160, 2),
    _wresnet("wresnet-500m", 50, 224, 2),
    _wresnet("wresnet-1b", 50, 320, 2),
    _wresnet("wresnet-2b", 50, 448, 2),
    _wresnet("wresnet-4b", 50, 640, 2),
    _wresnet("wresnet-6.8b", 50, 320, 16),
    _wresnet("wresnet-13b", 101, 320, 16),
    ZooEntry("gpt-tiny", gpt, GPTConfig(vocab=512, seq=32, hidden=64, layers=2, heads=4), 8, torch.float32, "test"),
    ZooEntry("gpt-small", gpt, GPTConfig(vocab=8192, seq=128, hidden=256, layers=4, heads=4), 16, torch.float32, _CPU),
    ZooEntry("gpt-small-eager", gpt, GPTConfig(vocab=8192, seq=128, hidden=256, layers=4, heads=4,
                                               fused_attention=False), 16, torch.float32, _CPU),
    ZooEntry("moe-small", moe, MoEConfig(vocab=8192, seq=128, hidden=256, layers=4, heads=4, experts=4,
                                         expert_group=256, ffn_mult=2), 16, torch.float32, _CPU),
    ZooEntry("wresnet-small", wresnet, WResNetConfig(stages=(1, 1, 1, 1), channels=32, width=2, image=64, classes=100),
             16, torch.float32, _CPU),
    ZooEntry(
        "moe-tiny", moe,
        MoEConfig(vocab=512, seq=32, hidden=64, layers=2, heads=4, experts=4, expert_group=64, ffn_mult=2),
        8, torch.float32, "test",
    ),
    ZooEntry(
        "wresnet-tiny", wresnet, WResNetConfig(stages=(1, 1), channels=8, width=2, image=32, classes=10),
        8, torch.float32, "test",
    ),
    ZooEntry("mlp-tiny", mlp, MLPConfig(dims=(32, 64, 64, 64, 10)), 16, torch.float32, "test"),
]

ZOO: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}
