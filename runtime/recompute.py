"""Activation recomputation as the planner prices it: a stage marked `recompute` keeps only its
input per microbatch and runs its forward again before its backward (`stage_costs`: the stage's
activations become a transient of one microbatch). That is one non-reentrant
`torch.utils.checkpoint` around the stage's whole forward: the model's forward for one-stage
plans, the stage's part of the graph in pipelines.

The recomputation restores the random state (dropout draws the same masks) and leaves the buffers
as the forward left them: BatchNorm would otherwise update its running statistics twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


def recomputed(forward: Callable, buffers: dict[str, torch.Tensor]) -> Callable:
    """`forward` under activation checkpointing (when gradients are on: a prediction saves nothing)."""

    def run(*inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*inputs)
        after_forward: list[torch.Tensor] = []

        def once(*args: Any) -> Any:
            out = forward(*args)
            with torch.no_grad():
                if not after_forward:  # the forward: remember what it left
                    after_forward.extend(b.detach().clone() for b in buffers.values())
                else:  # the recomputation: put it back
                    for b, value in zip(buffers.values(), after_forward):
                        b.copy_(value)
            return out

        with set_checkpoint_early_stop(False):  # the whole forward again, so its end puts the buffers back
            return checkpoint(once, *inputs, use_reentrant=False)

    return run
