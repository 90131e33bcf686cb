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
import sysconfig
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from autopar.contract.errors import CaptureError

WRAPPER_PREFIX = "inner."  # the wrapper holds the model as `inner`
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_INSTALLED = (sysconfig.get_paths()["purelib"] + os.sep, sysconfig.get_paths()["platlib"] + os.sep)


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
            out = inner(*args, **kwargs, **extra)
            self.form = OutputForm.of(out)
            return first_tensor(out)

        forward.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in extra])
        self.forward = forward


@dataclass
class OutputForm:
    """What the model returns, around the one tensor its graph returns: a module running the graph
    hands back the model's own output type (a `ModelOutput` with its `logits`) where that tensor
    is all it holds."""

    spec: TreeSpec
    leaves: list[Any]  # the output's leaves, tensors as None
    index: int  # the leaf the graph returns
    tensors: int  # how many of the leaves are tensors

    @staticmethod
    def of(out: Any) -> OutputForm:
        leaves, spec = tree_flatten(out)
        chosen = first_tensor(out)
        return OutputForm(spec, [None if isinstance(x, torch.Tensor) else x for x in leaves],
                          next(i for i, x in enumerate(leaves) if x is chosen),
                          sum(isinstance(x, torch.Tensor) for x in leaves))

    def rebuild(self, tensor: torch.Tensor) -> Any:
        """The model's output holding `tensor`; `tensor` itself where the output held others too."""
        if self.tensors != 1:
            return tensor
        leaves = list(self.leaves)
        leaves[self.index] = tensor
        return tree_unflatten(leaves, self.spec)


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


def export_program(model: nn.Module, args: tuple) -> torch.export.ExportedProgram:
    # a failed export prints its partial graph to stderr and logs warnings about it: the error
    # below says what failed and where; what a successful export says is passed on
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    said = io.StringIO()
    wrapper = _TensorOutput(model)
    try:
        with contextlib.redirect_stderr(said), _unchanging_to():
            exported = torch.export.export(wrapper, args, strict=False)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(_explain(exc, model)) from exc
    finally:
        shapes.setLevel(level)
    sys.stderr.write(said.getvalue())
    exported.output_form = wrapper.form  # (`OutputForm`: the runtime's module returns the model's type)
    return exported


@contextlib.contextmanager
def _unchanging_to():
    """`module.to(dtype)` that changes nothing returns the module while exporting. Some models cast
    a submodule in their forward (Switch Transformers' router: `self.classifier =
    self.classifier.to(self.dtype)`); export cannot swap a traced parameter, and nothing changes."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all((device is None or t.device == device) and
                                         (dtype is None or not t.is_floating_point() or t.dtype == dtype)
                                         for t in tensors):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


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
    """The model's own code: not torch's, autopar's or Python's (a model from an installed package,
    `transformers` say, counts: its line is where the construct is)."""
    stdlib = filename.startswith(_STDLIB) and not filename.startswith(_INSTALLED)
    return not stdlib and not filename.startswith((os.path.dirname(torch.__file__), _PACKAGE, "<"))


def _user_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def source_line(node: Any) -> str:
    """The model's own line that made this node (export records the stack), as ' at FILE:LINE: code'."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip()]
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].startswith("File "):
            code = frames[i + 1] if i + 1 < len(frames) else ""
            return f" at {frames[i].removeprefix('File ')}: {code}"
    return ""


def differentiated(graph: torch.fx.Graph, trainable: set[str]) -> set[str]:
    """The nodes backward differentiates: floating-point values computed from `trainable` (the
    placeholders of parameters that require gradients). A value no such parameter feeds (a rotary
    table, a mask) carries no gradient, across a pipeline boundary too."""
    out = set(trainable)
    for node in graph.nodes:
        if node.op == "call_function" and any(n.name in out for n in node.all_input_nodes) and any(
                isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
                for v in tree_leaves(node.meta.get("val"))):
            out.add(node.name)
    return out


def trainable_placeholders(ep: torch.export.ExportedProgram, model: nn.Module) -> set[str]:
    """The placeholders of `ep` (exported from `model`, perhaps wrapped) whose parameters require gradients."""
    named = dict(model.named_parameters(remove_duplicate=False))
    return {ph for ph, fqn in ep.graph_signature.inputs_to_parameters.items()
            if getattr(named.get(fqn.removeprefix(WRAPPER_PREFIX)), "requires_grad", False)}

