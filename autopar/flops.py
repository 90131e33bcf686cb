"""Forward and backward FLOPs of one aten op, counted by `torch.utils.flop_counter`.

Each op is replayed on `meta` tensors of its recorded shapes under `FlopCounterMode`, forward
and then backward (gradients only for inputs that need them), so the formulas are torch's own
and the count does not depend on the device the model was captured on (on CPU, torch's
attention kernel has no registered formula; on `meta` it dispatches to one that has).
Identical ops (same op, shapes, dtypes, arguments) are replayed once: a 96-layer GPT has a few
dozen distinct ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode


class FlopCounter:
    """Counts an op's FLOPs; holds the cache of ops already replayed."""

    def __init__(self) -> None:
        self._cache: dict[Any, tuple[float, float]] = {}
        self.failures: dict[str, str] = {}  # op -> why it could not be replayed

    def count(self, target: Any, args: tuple, kwargs: dict, grad_of: set[int]) -> tuple[float, float]:
        """FLOPs of ``target(*args, **kwargs)``; tensors whose id() is in `grad_of` need gradients."""
        leaves, spec = tree_flatten((args, kwargs))
        key = (target, str(spec), tuple(_leaf_key(x, grad_of) for x in leaves))
        if key not in self._cache:
            self._cache[key] = self._replay(target, args, kwargs, grad_of)
        return self._cache[key]

    def _replay(self, target: Any, args: tuple, kwargs: dict, grad_of: set[int]) -> tuple[float, float]:
        def to_meta(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return t.requires_grad_() if id(x) in grad_of else t

        try:
            margs, mkwargs = tree_map(to_meta, (args, kwargs))
            with FlopCounterMode(display=False) as fwd:
                out = target(*margs, **mkwargs)
        except Exception as exc:  # an op without a meta kernel: record it, count nothing
            self.failures[str(target)] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return 0.0, 0.0
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        ins = [t for t in tree_leaves((margs, mkwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not ins:
            return float(fwd.get_total_flops()), 0.0
        try:
            with FlopCounterMode(display=False) as bwd:
                torch.autograd.grad(outs, ins, [torch.empty_like(o) for o in outs], allow_unused=True)
        except Exception as exc:
            # No meta backward: assume the usual 2x forward (one product per input and weight).
            self.failures[f"{target} (backward)"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return float(fwd.get_total_flops()), 2.0 * fwd.get_total_flops()
        return float(fwd.get_total_flops()), float(bwd.get_total_flops())


def _leaf_key(x: Any, grad_of: set[int]) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, id(x) in grad_of)
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)
