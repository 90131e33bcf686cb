"""Resolve a MODEL argument (zoo name, `FILE.py:FUNCTION` or `package.module:FUNCTION`) into a workload."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.contract.errors import ModelSpecError
from autopar.contract.inputs import as_args
from autopar.contract.limits import MAX_BATCH
from autopar.contract.workload import Workload
from autopar.zoo import ZOO


def load_workload(spec: str, *, batch: int | None = None, device: str | torch.device = "meta",
                  dtype: torch.dtype | None = None) -> Workload:
    """Build the model `spec` names: a zoo name (`gpt-1.3b`), or `FILE.py:FUNCTION` /
    `package.module:FUNCTION` returning `(model, example_inputs)` or `(model, example_inputs,
    loss_fn, make_batch)`. Zoo models are built on `device` (meta: no memory) in `dtype`; `batch`
    replaces the suite's default global batch. Raises `ModelSpecError` for a spec it cannot build."""
    if batch is not None and not 1 <= batch <= MAX_BATCH:
        raise ModelSpecError(f"--batch must be a positive integer of at most {MAX_BATCH}, got {batch}")
    if ":" in spec:
        return _from_function(spec, batch)
    entry = ZOO.get(spec)
    if entry is None:
        close = difflib.get_close_matches(spec, ZOO, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ModelSpecError(
            f"unknown model {spec!r}: {hint}zoo models are {', '.join(ZOO)}; "
            "or give FILE.py:FUNCTION or package.module:FUNCTION returning (model, example_inputs)"
        )
    batch = batch or entry.batch
    with torch.device(device):
        model = entry.family.build(entry.config)
    if (dtype or entry.dtype) != torch.float32:
        model = model.to(dtype or entry.dtype)
    cfg, fam = entry.config, entry.family
    return Workload(
        name=spec,
        model=model,
        example_inputs=fam.example_inputs(cfg, batch, device),
        batch=batch,
        loss_fn=fam.loss_fn,
        make_batch=lambda b, gen: fam.make_batch(cfg, b, gen),
    )


def _from_function(spec: str, batch: int | None) -> Workload:
    target, _, func_name = spec.rpartition(":")
    module = _import(target, spec)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ModelSpecError(f"{spec}: {target} has no function {func_name!r}")
    try:
        result = func()
    except Exception as exc:
        raise ModelSpecError(f"{spec}: calling {func_name}() failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, tuple) or len(result) not in (2, 4) or not isinstance(result[0], nn.Module):
        raise ModelSpecError(
            f"{spec}: {func_name}() must return (model, example_inputs) or "
            f"(model, example_inputs, loss_fn, make_batch), got {type(result).__name__}"
        )
    model, inputs = result[0], result[1]
    inputs = as_args(model.forward, inputs, f"{spec}: example_inputs")
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if first is None:
        raise ModelSpecError(f"{spec}: example_inputs has no tensor with a batch dimension")
    if batch is not None:
        inputs = tuple(_resize_batch(x, first.shape[0], batch) for x in inputs)
    loss_fn, make_batch = (result[2], result[3]) if len(result) == 4 else (None, None)
    return Workload(spec, model, inputs, batch or first.shape[0], loss_fn, make_batch)


def _import(target: str, spec: str) -> Any:
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ModelSpecError(f"{spec}: no file {target}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"{spec}: cannot import {target}: {type(exc).__name__}: {exc}") from exc


def _resize_batch(x: Any, old: int, batch: int) -> Any:
    """Repeat (or cut) the example batch to `batch` rows, keeping values valid (token ids stay ids).

    Only tensors whose first dimension is the example batch are resized (not, e.g., a bias input).
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != old:
        return x
    rows = torch.arange(batch, device=x.device) % x.shape[0]
    return x.index_select(0, rows)
