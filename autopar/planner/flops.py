"""Forward and backward FLOPs of one aten op, counted by `torch.utils.flop_counter`.

Each op is replayed on `meta` tensors of its recorded shapes under `FlopCounterMode`, forward
and then backward (gradients only for inputs that need them), so the formulas are torch's own
and the count does not depend on the device the model was captured on (on CPU, torch's
attention kernel has no registered formula; on `meta` it dispatches to one that has).
Identical ops (same op, shapes, dtypes, arguments) are replayed once: a 96-layer GPT has a few
dozen distinct ops.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula


def _grouped_mm(a_shape: tuple, b_shape: tuple, *args: Any, out_shape: tuple, **kwargs: Any) -> int:
    """A grouped matmul (a mixture of experts' tokens × their experts' weights): each output
    element is one dot product over the contraction a_shape[-1]."""
    return 2 * prod(out_shape) * a_shape[-1]


def _grouped_mm_backward(a_shape: tuple, b_shape: tuple, offs: tuple, grad_shape: tuple, *args: Any,
                         **kwargs: Any) -> int:
    """Input and weight gradients: two grouped matmuls of the forward's size."""
    return 2 * _grouped_mm(a_shape, b_shape, out_shape=grad_shape)


# ops torch has no formula for, by namespace::name (registered when their library is loaded);
# transformers' grouped matmul runs Mixtral's, Qwen-MoE's, ... experts on data-dependent token counts
FORMULAS = {
    "aten::_grouped_mm": _grouped_mm,
    "transformers::grouped_mm_fallback": _grouped_mm,
    "transformers::grouped_mm_fallback_backward": _grouped_mm_backward,
}


def _register_formulas() -> None:
    """Put FORMULAS into torch's registry for the ops whose library is loaded (once per process)."""
    for qualified, formula in FORMULAS.items():
        namespace, _, name = qualified.partition("::")
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None and packet not in flop_registry:
            register_flop_formula(packet)(formula)


def _is_custom(target: Any) -> bool:
    """An op of a library outside torch (`torch.library.custom_op`): FlopCounterMode counts it as 0."""
    return getattr(target, "namespace", "aten") not in ("aten", "prims", "_c10d_functional", "c10d")


class FlopCounter:
    """Counts an op's FLOPs; holds the cache of ops already replayed."""

    def __init__(self) -> None:
        _register_formulas()
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
            if target._schema.is_mutable and margs and getattr(margs[0], "requires_grad", False):
                margs = (margs[0].clone(), *margs[1:])  # an in-place op on a leaf: on a copy of it
            with FlopCounterMode(display=False) as fwd:
                out = target(*margs, **mkwargs)
        except Exception as exc:  # an op without a meta kernel: record it, count nothing
            self.failures[str(target)] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return 0.0, 0.0
        if _is_custom(target) and target.overloadpacket not in flop_registry:
            self.failures[str(target)] = ("a custom op with no FLOP formula: priced by the bytes it moves alone "
                                          "(register one with torch.utils.flop_counter.register_flop_formula)")
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
