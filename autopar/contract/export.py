"""The export both sides share: the planner captures the model with it at the global batch, the
runtime exports it again at a microbatch; the two must agree on the wrapper and its node names.

The model is wrapped so that whatever it returns (a tensor, a tuple, a `ModelOutput` with
`logits`) the graph has one tensor output; export failures become one `CaptureError` naming the
user's source line.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import sys
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autopar.contract.errors import CaptureError

WRAPPER_PREFIX = "inner."  # the wrapper holds the model as `inner`
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _TensorOutput(nn.Module):
    """Calls the model and returns one tensor, so any model exports the same way.

    The wrapper takes the model's own signature, so graph inputs keep the model's argument names.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        sig = inspect.signature(inner.forward)
        extra = {"use_cache": False} if "use_cache" in sig.parameters else {}

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            return first_tensor(inner(*args, **kwargs, **extra))

        forward.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in extra])
        self.forward = forward


def first_tensor(out: Any) -> torch.Tensor:
    """The tensor a model's output stands for: itself, `.logits`, or the first tensor inside."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise CaptureError(f"the model returned {type(out).__name__} with no tensor in it; return the logits or loss")


def export_program(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    # a failed export prints its partial graph to stderr and logs warnings about it: the error
    # below says what failed and where; what a successful export says is passed on
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            exported = torch.export.export(_TensorOutput(model), args, kwargs, strict=False)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(_explain(exc, model)) from exc
    finally:
        shapes.setLevel(level)
    sys.stderr.write(said.getvalue())
    return exported


def _explain(exc: Exception, model: nn.Module) -> str:
    """One message: what failed, where in the user's code, and what usually fixes it."""
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__).strip()
    where = _user_frame(exc)
    hint = ""
    if "data-dependent" in str(exc) or "GuardOnDataDependent" in type(exc).__name__:
        op = _culprit(exc)
        first = (f"{op + ' needs the value of a tensor: ' if op else ''}control flow or a shape depends on "
                 f"the value of a tensor ({first})")
        hint = "make it independent of tensor values (torch.where, masks, or torch.cond)"
    return (
        f"cannot capture {type(model).__name__} with torch.export: {first}"
        + (f"\n  at {where}" if where else "")
        + (f"\n  hint: {hint}" if hint else "")
    )


def _culprit(exc: BaseException) -> str:
    """The tensor operation the user's line called that needed a value (`Tensor.__bool__` for an
    `if` on a tensor, `Tensor.item`, `Tensor.nonzero`, ...): torch's dispatch frames hold it as `func`."""
    user = _is_user_file
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    last = max((i for i, f in enumerate(frames) if user(f.f_code.co_filename)), default=None)
    if last is None:
        return ""
    for frame in frames[last + 1:]:
        func = frame.f_locals.get("func")
        if callable(func) and getattr(func, "__name__", ""):
            owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
            prefix = "Tensor." if owner is torch.Tensor or "Tensor" in getattr(owner, "__name__", "") else ""
            return f"{prefix}{func.__name__}"
    return ""


def _is_user_file(filename: str) -> bool:
    return not filename.startswith((os.path.dirname(torch.__file__), _PACKAGE, "<")) \
        and "site-packages" not in filename.split(os.sep)[-4:]


def _user_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
