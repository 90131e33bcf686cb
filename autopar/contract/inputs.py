"""The input contract: a model's inputs, the same wherever autopar takes them.

`capture`, `parallelize`, a MODEL function given to the CLI (its `example_inputs`), and a parallel
model's `step` / `predict` all accept:

- a tuple (or list) of positional inputs: `(input_ids, attention_mask)`;
- a dict of keyword inputs: `{"input_features": x, "decoder_input_ids": y}`, bound to the model's
  `forward` parameters by name; parameters skipped before the last one given take their defaults
  (T5's `attention_mask=None` between `input_ids` and `decoder_input_ids`);
- one tensor: `x`, the same as `(x,)`.

Tensors lead with the batch dimension. Anything else is refused with one message (`as_args`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from autopar.contract.errors import AutoparError

CONTRACT = "a tuple of positional inputs, a dict of keyword inputs, or one tensor"


class InputError(AutoparError):
    """Model inputs outside the contract."""


def as_args(forward: Callable, inputs: Any, what: str = "inputs") -> tuple:
    """The model's inputs as positional arguments of `forward` (see the module docstring)."""
    if isinstance(inputs, dict):
        return _bound(forward, inputs, what)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    raise InputError(f"{what} must be {CONTRACT}; got {type(inputs).__name__}")


def _bound(forward: Callable, inputs: dict, what: str) -> tuple:
    params = list(inspect.signature(forward).parameters.values())
    known = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = [name for name in inputs if name not in known]
    if unknown:
        raise InputError(f"{what}: the model's forward takes no parameter {', '.join(map(repr, unknown))} by "
                         f"position or name; its parameters are {', '.join(known)}")
    if not inputs:
        raise InputError(f"{what} must be {CONTRACT}; got an empty dict")
    last = max(known.index(name) for name in inputs)
    missing = [p.name for p in params[:last + 1] if p.name not in inputs and p.default is p.empty]
    if missing:
        raise InputError(f"{what}: keyword inputs skip {', '.join(missing)}, which the model's forward needs "
                         "(it has no default)")
    return tuple(inputs[p.name] if p.name in inputs else p.default for p in params[:last + 1])
