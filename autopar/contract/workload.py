"""What the planner is given: a model with example inputs of its global batch (`load_workload`
builds one from a zoo name or a user's function)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Workload:
    """A model with inputs of its global batch; loss and synthetic data when the spec provides them."""

    name: str
    model: nn.Module
    example_inputs: tuple
    batch: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    make_batch: Callable[[int, torch.Generator], tuple[tuple, torch.Tensor]] | None = None
