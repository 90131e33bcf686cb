"""Every op described as an einsum: one letter per tensor dimension.

A sharding of an op on one mesh axis is the choice of one letter to split (or none). Tensors
holding the letter are `S(its position)`; the others are replicated; the output is `S(pos)` when
it holds the letter and `P` (partial sums) when the letter is contracted away by a linear op.
This one rule gives Megatron's column- (split `n`) and row-parallel (split `k`, output `P`)
linears, batch and sequence splits, attention by heads, vocabulary-parallel embeddings,
channel-parallel convolutions and expert-parallel MoE einsums. Followers (element-wise ops,
views, reductions) are described the same way, so a placement can be carried through them.
"""

from __future__ import annotations

import math
import operator
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

# How an op relates to sharding: anchors choose a letter; followers inherit their input's.
ANCHOR, FOLLOWER, SOURCE, UNKNOWN, NOOP = "anchor", "follower", "source", "unknown", "noop"


Builder = Callable[[fx.Node, list, list], "Signature | None"]
RULES: dict[str, Builder] = {}  # "aten.mm" (an op's overload packet) -> its rule


def rule(*ops: Any) -> Callable[[Builder], Builder]:
    """Registers the decorated function as the rule of `ops` (`aten.mm`, or "ns.op" for an op that
    may not exist in every torch): `fn(node, input shapes, output shapes) -> Signature`, or None to
    fall through to the generic rules. Every overload of an op shares its rule."""

    def register(fn: Builder) -> Builder:
        for op in ops:
            RULES[op if isinstance(op, str) else str(op)] = fn
        return fn

    return register


@dataclass
class Signature:
    inputs: list[str | None]  # letters of each input of fx `all_input_nodes` order (None: not a tensor)
    outputs: list[str]  # letters of each output tensor
    kind: str
    shardable: set[str] = field(default_factory=set)  # letters an anchor may split
    linear: bool = False  # contracting (or reducing) a letter yields partial sums, P
    view: bool = False  # moves no data: a partial (P) input stays partial
    addends: frozenset[int] = frozenset()  # inputs added to a linear op's product (biases), not multiplied


class _Letters:
    """Fresh letters for one signature."""

    def __init__(self) -> None:
        self._it: Iterator[str] = iter(string.ascii_letters)

    def take(self, n: int) -> str:
        return "".join(next(self._it) for _ in range(n))


def _shape(val: Any) -> tuple[int, ...] | None:
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def signature(node: fx.Node) -> Signature:
    """The einsum view of `node`, from its args and the shapes recorded by torch.export."""
    ins = [_shape(n.meta.get("val")) for n in node.all_input_nodes]
    val = node.meta.get("val")
    outs = [_shape(v) for v in (val if isinstance(val, (tuple, list)) else [val])]
    outs = [o for o in outs if o is not None]
    if not outs:
        return Signature([None] * len(ins), [], NOOP)  # assertions and other ops without tensor results
    if not ins:
        fresh = _Letters()
        return Signature([], [fresh.take(len(o)) for o in outs], SOURCE)
    target = node.target
    builder = RULES.get(str(target.overloadpacket)) if isinstance(target, torch._ops.OpOverload) else None
    if builder is not None:
        sig = builder(node, ins, outs)
        if sig is not None:
            return sig
    if target is operator.getitem:
        return _getitem(node, ins, outs)
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags and len(outs) == 1:
        return _pointwise(ins, outs[0])
    # no rule: every tensor gets letters of its own, so nothing can stay split through the op
    fresh = _Letters()
    return Signature([fresh.take(len(s)) if s is not None else None for s in ins],
                     [fresh.take(len(o)).upper() for o in outs], UNKNOWN)


def _arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """An argument by its schema name, positional or keyword."""
    schema = getattr(node.target, "_schema", None)
    if name in node.kwargs:
        return node.kwargs[name]
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.name == name:
                if i < len(node.args):
                    return node.args[i]
                return arg.default_value if arg.has_default_value() else default
    return default


def _args(node: fx.Node) -> list:
    """Positional args followed by the schema's defaults, so builders can index them."""
    schema = getattr(node.target, "_schema", None)
    args = list(node.args)
    if schema is not None:
        for arg in schema.arguments[len(args):]:
            args.append(node.kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None))
    return args


def _input_index(node: fx.Node, arg: Any) -> int | None:
    return node.all_input_nodes.index(arg) if isinstance(arg, fx.Node) else None


def _place(node: fx.Node, ins: list, assign: dict[int, str]) -> list[str | None]:
    """Letters per input (fx order) from {index in all_input_nodes: letters}; other tensors get fresh ones."""
    fresh = _Letters()
    used = set("".join(assign.values()))
    out: list[str | None] = []
    for i, shape in enumerate(ins):
        if i in assign:
            out.append(assign[i])
        elif shape is None:
            out.append(None)
        else:
            letters = ""
            while len(letters) < len(shape):
                c = fresh.take(1)
                if c not in used:
                    letters += c
            out.append(letters)
    return out


# ---- anchors -------------------------------------------------------------------------------

def _matmul_letters(a: tuple, b: tuple, out: tuple) -> tuple[str, str, str]:
    """numpy matmul broadcasting: batch dims aligned right, then m k @ k n."""
    batch = "bcdefg"[: len(out) - 2]
    la = batch[len(batch) - (len(a) - 2):] + "mk"
    lb = batch[len(batch) - (len(b) - 2):] + "kn"
    # a broadcast (size-1) batch dim is not the output's: give it a letter of its own
    la = "".join(c if i >= len(a) - 2 or a[i] == out[len(out) - len(a) + i] else c.upper() for i, c in enumerate(la))
    lb = "".join(c if i >= len(b) - 2 or b[i] == out[len(out) - len(b) + i] else c.upper() for i, c in enumerate(lb))
    return la, lb, batch + "mn"


@rule(aten.linear)
def _linear(node, ins, outs):
    args = _args(node)
    x = _shape(args[0].meta["val"])
    lead = string.ascii_lowercase[: len(x) - 1].replace("k", "z").replace("n", "y")
    assign = {_input_index(node, args[0]): lead + "k", _input_index(node, args[1]): "nk"}
    bias = _input_index(node, args[2])
    if bias is not None:
        assign[bias] = "n"
    return Signature(_place(node, ins, assign), [lead + "n"], ANCHOR, set(lead + "kn"), linear=True,
                     addends=frozenset({bias} - {None}))


@rule(aten.mm, aten.bmm, aten.matmul)
def _mm(node, ins, outs, bias_first: bool = False):
    args = _args(node)
    a, b = (args[1], args[2]) if bias_first else (args[0], args[1])
    if len(_shape(a.meta["val"])) < 2 or len(_shape(b.meta["val"])) < 2:
        return None  # matrix-vector products: no rule, the fallback replicates them
    la, lb, lo = _matmul_letters(_shape(a.meta["val"]), _shape(b.meta["val"]), outs[0])
    assign = {_input_index(node, a): la, _input_index(node, b): lb}
    addends = frozenset()
    if bias_first and isinstance(args[0], fx.Node):
        bias = _shape(args[0].meta["val"])
        assign[_input_index(node, args[0])] = lo[len(lo) - len(bias):] if bias else ""
        addends = frozenset({_input_index(node, args[0])})
    if len(set(assign.values())) < len(assign) and _input_index(node, a) == _input_index(node, b):
        return None  # x @ x: one input in two roles; leave to the fallback
    return Signature(_place(node, ins, assign), [lo], ANCHOR, set(la + lb), linear=True, addends=addends)


@rule(aten.addmm, aten.baddbmm)
def _addmm(node, ins, outs):
    return _mm(node, ins, outs, bias_first=True)


@rule(aten.einsum)
def _einsum(node, ins, outs):
    args = _args(node)
    lhs, _, rhs = args[0].replace(" ", "").partition("->")
    terms = lhs.split(",")
    if "." in args[0] or len(terms) != len(args[1]) or len(set(args[1])) != len(args[1]):
        return None
    assign = {_input_index(node, t): term for t, term in zip(args[1], terms)}
    return Signature(_place(node, ins, assign), [rhs], ANCHOR, set(lhs) - {","}, linear=True)


@rule(aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution)
def _conv(node, ins, outs):
    args = _args(node)
    x, w = _shape(args[0].meta["val"]), _shape(args[1].meta["val"])
    groups = args[-1] if isinstance(args[-1], int) else 1
    if len(x) != len(w):
        return None
    spatial_in, spatial_w, spatial_out = "HWD"[: len(x) - 2], "KLM"[: len(x) - 2], "XYZ"[: len(x) - 2]
    # grouped (ConvNeXt's and MobileNet's depthwise): each group reads its own input channels, so
    # only the batch carries through (a channel split would change the groups each rank runs)
    c, shardable = ("c", {"b", "o", "c"}) if groups == 1 else ("CG", {"b"})
    assign = {_input_index(node, args[0]): "b" + c[0] + spatial_in, _input_index(node, args[1]): "o" + c[-1] + spatial_w}
    bias = _input_index(node, args[2])
    if bias is not None:
        assign[bias] = "o"
    return Signature(_place(node, ins, assign), ["bo" + spatial_out], ANCHOR, shardable, linear=groups == 1,
                     addends=frozenset({bias} - {None}))


@rule("aten._grouped_mm", "transformers.grouped_mm_fallback")
def _grouped_mm(node, ins, outs):
    """A mixture of experts' grouped matmul: tokens sorted by expert (`sk`) times every expert's
    weight (`ekn`), `offs` each expert's running token count. Splitting the experts `e` is expert
    parallelism: a rank multiplies its experts' tokens and leaves the others' rows zero, a partial
    sum; `n` and `k` split every expert as Megatron splits a linear. `offs` stays whole (a rank needs
    every expert's boundaries) and tokens are never split: where they go depends on the data."""
    args = _args(node)
    if len(args) < 3 or not all(isinstance(a, fx.Node) for a in args[:3]):
        return None
    x, w = _shape(args[0].meta["val"]), _shape(args[1].meta["val"])
    if x is None or w is None or len(x) != 2 or len(w) != 3:
        return None
    assign = {_input_index(node, args[0]): "sk", _input_index(node, args[1]): "ekn", _input_index(node, args[2]): "E"}
    return Signature(_place(node, ins, assign), ["sn"], ANCHOR, {"e", "k", "n"}, linear=True)


@rule(aten.embedding)
def _embedding(node, ins, outs):
    args = _args(node)
    idx = _shape(args[1].meta["val"])
    lead = "abcdefg"[: len(idx)]
    assign = {_input_index(node, args[0]): "vh", _input_index(node, args[1]): lead}
    return Signature(_place(node, ins, assign), [lead + "h"], ANCHOR, set(lead + "vh"), linear=True)


def _norm(node, ins, outs, normalized: int | None = None):
    """layer_norm / rms_norm over the last `normalized` dims; batch_norm over all but channels."""
    args = _args(node)
    x = _shape(args[0].meta["val"])
    letters = string.ascii_lowercase[: len(x)]
    if normalized is None:  # batch norm: per-channel statistics, so batch and channels can be split
        norm_letters, shardable = letters[:1] + letters[2:], {letters[0], letters[1]}
        params = letters[1]
    else:
        norm_letters = letters[len(x) - normalized:]
        shardable, params = set(letters) - set(norm_letters), norm_letters
    assign = {_input_index(node, args[0]): letters}
    for a in args[1:]:
        if isinstance(a, fx.Node) and _shape(a.meta["val"]) is not None:
            assign[_input_index(node, a)] = params
    stats = [letters if i == 0 else "".join(c if c not in norm_letters else c.upper() for c in letters)[: len(o)]
             for i, o in enumerate(outs)]
    return Signature(_place(node, ins, assign), stats, ANCHOR, shardable)


@rule(aten.layer_norm, aten.native_layer_norm, aten.rms_norm)
def _layer_norm(node, ins, outs):
    return _norm(node, ins, outs, len(_args(node)[1]))


@rule(aten.batch_norm, aten._native_batch_norm_legit_functional,
      aten._native_batch_norm_legit_no_training)
def _batch_norm(node, ins, outs):
    return _norm(node, ins, outs, None)


@rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)
def _softmax(node, ins, outs):
    args = _args(node)
    x = _shape(args[0].meta["val"])
    letters = string.ascii_lowercase[: len(x)]
    dim = args[1] % len(x)
    return Signature(_place(node, ins, {0: letters}), [letters], ANCHOR, set(letters) - {letters[dim]})


@rule(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu,
      aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention)
def _sdpa(node, ins, outs):
    args = _args(node)
    q = _shape(args[0].meta["val"])
    if len(q) != 4:
        return None
    assign = {_input_index(node, args[0]): "bhsd", _input_index(node, args[1]): "bhtd", _input_index(node, args[2]): "bhte"}
    if len(assign) < 3:
        return None
    mask = args[3] if len(args) > 3 and isinstance(args[3], fx.Node) else None
    if mask is not None:
        m = _shape(mask.meta["val"])
        assign[_input_index(node, mask)] = "".join(c if size != 1 else c.upper() for c, size in zip("bhst"[4 - len(m):], m))
    out_letters = ["bhse"] + [("bhs" + "XYZ")[: len(o)] for o in outs[1:]]
    return Signature(_place(node, ins, assign), out_letters, ANCHOR, {"b", "h"})


@rule(aten.cross_entropy_loss)
def _cross_entropy(node, ins, outs):
    args = _args(node)
    logits, target = _shape(args[0].meta["val"]), _shape(args[1].meta["val"])
    if len(logits) != 2 or len(target) != 1:
        return None
    assign = {_input_index(node, args[0]): "bv", _input_index(node, args[1]): "b"}
    out = "b" if outs and outs[0] else ""  # reduction "none" keeps the batch; mean and sum reduce it
    return Signature(_place(node, ins, assign), [out], ANCHOR, {"b"}, linear=True)


# ---- followers -----------------------------------------------------------------------------

def _pointwise(ins, out):
    letters = string.ascii_lowercase[: len(out)]
    fresh = iter(string.ascii_uppercase)
    placed = []
    for shape in ins:
        if shape is None:
            placed.append(None)
            continue
        lead = len(out) - len(shape)
        placed.append("".join(letters[lead + i] if size == out[lead + i] else next(fresh) for i, size in enumerate(shape)))
    return Signature(placed, [letters], FOLLOWER)


@rule(aten.alias, aten.detach, aten.clone, aten.contiguous, aten._to_copy, aten.to, aten.type_as)
def _same(node, ins, outs):
    letters = string.ascii_lowercase[: len(ins[0])]
    placed = _place(node, ins, {0: letters})
    if "type_as" in str(node.target):  # `x.type_as(other)` reads only other's dtype: no placement to need
        placed[1:] = [None] * (len(placed) - 1)
    return Signature(placed, [letters], FOLLOWER, view=True)


@rule(aten.dropout, aten.dropout_, aten.feature_dropout, aten.alpha_dropout)
def _elementwise(node, ins, outs):
    letters = string.ascii_lowercase[: len(ins[0])]
    return Signature(_place(node, ins, {0: letters}), [letters] * len(outs), FOLLOWER)


@rule(aten.view, aten._unsafe_view, aten.reshape, aten.flatten, aten.unflatten)
def _reshape(node, ins, outs):
    """Merged dims keep the outer dim's letter; a split dim gives its letter to the outer part."""
    src, dst = ins[0], outs[0]
    a, b = _Letters().take(len(src)), list(string.ascii_uppercase[: len(dst)])
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        while pi != pj:
            if (pi < pj and i + 1 >= len(src)) or (pi > pj and j + 1 >= len(dst)):
                break
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= src[i]
            else:
                j += 1
                gj.append(j)
                pj *= dst[j]
        first_in = next((k for k in gi if src[k] != 1), None)
        first_out = next((k for k in gj if dst[k] != 1), None)
        if first_in is not None and first_out is not None:
            b[first_out] = a[first_in]
        i, j = i + 1, j + 1
    return Signature(_place(node, ins, {0: a}), ["".join(b)], FOLLOWER, view=True)


@rule(aten.transpose, aten.t, aten.permute, aten.numpy_T, aten.mT, aten.mH, aten.adjoint, aten.swapaxes,
      aten.swapdims, aten.movedim)
def _permute(node, ins, outs):
    """Every way of reordering dims: `x.T` (numpy_T, all of them reversed), `x.mT` and its conjugate
    forms (the last two swapped), transpose and its aliases, permute, movedim."""
    args = _args(node)
    letters = string.ascii_lowercase[: len(ins[0])]
    n = len(letters)
    packet = node.target.overloadpacket
    perm = list(range(n))
    if packet in (aten.t, aten.numpy_T):
        perm.reverse()
    elif packet in (aten.mT, aten.mH, aten.adjoint):
        perm[-2:] = perm[:-3:-1]
    elif packet in (aten.transpose, aten.swapaxes, aten.swapdims):
        d0, d1 = args[1] % n, args[2] % n
        perm[d0], perm[d1] = perm[d1], perm[d0]
    elif packet is aten.movedim:
        src, dst = ([d % n for d in a] if isinstance(a, (list, tuple)) else [a % n] for a in args[1:3])
        rest = iter(d for d in perm if d not in src)
        moved = dict(zip(dst, src))
        perm = [moved[i] if i in moved else next(rest) for i in range(n)]
    else:
        perm = [d % n for d in args[1]]
    return Signature(_place(node, ins, {0: letters}), ["".join(letters[p] for p in perm)], FOLLOWER, view=True)


@rule(aten.expand, aten.unsqueeze, aten.squeeze, aten.select, aten.slice)
def _expand_like(node, ins, outs):
    """expand / unsqueeze / squeeze / select / slice: letters kept where the size is kept."""
    src, dst = ins[0], outs[0]
    a = string.ascii_lowercase[: len(src)]
    args = _args(node)
    keep = {}
    if node.target in (aten.expand.default,):
        lead = len(dst) - len(src)
        keep = {i: lead + i for i in range(len(src)) if src[i] == dst[lead + i]}
    elif node.target in (aten.unsqueeze.default,):
        d = args[1] % (len(src) + 1)
        keep = {i: i if i < d else i + 1 for i in range(len(src))}
    elif node.target in (aten.select.int,):
        d = args[1] % len(src)
        keep = {i: i if i < d else i - 1 for i in range(len(src)) if i != d}
    elif node.target in (aten.slice.Tensor,):
        d = args[1] % len(src)
        keep = {i: i for i in range(len(src)) if i != d or src[i] == dst[i]}
    else:  # squeeze: drop size-1 dims
        kept = [i for i in range(len(src)) if not (src[i] == 1 and len(dst) < len(src))]
        if len(kept) != len(dst):
            kept = [i for i in range(len(src)) if src[i] != 1]
        keep = {k: j for j, k in enumerate(kept)} if len(kept) == len(dst) else {}
    out = list(string.ascii_uppercase[: len(dst)])
    for i, j in keep.items():
        out[j] = a[i]
    return Signature(_place(node, ins, {0: a}), ["".join(out)], FOLLOWER, view=True)


@rule(aten.split, aten.split_with_sizes, aten.chunk)
def _split(node, ins, outs):
    args = _args(node)
    letters = string.ascii_lowercase[: len(ins[0])]
    d = args[2] % len(letters) if len(args) > 2 and isinstance(args[2], int) else 0
    out = letters[:d] + "Z" + letters[d + 1:]
    return Signature(_place(node, ins, {0: letters}), [out] * len(outs), FOLLOWER, view=True)


@rule(aten.unbind)
def _unbind(node, ins, outs):
    d = _arg(node, "dim", 0) % len(ins[0])
    letters = string.ascii_lowercase[: len(ins[0])]
    return Signature(_place(node, ins, {0: letters}), [letters[:d] + letters[d + 1:]] * len(outs), FOLLOWER, view=True)


def _getitem(node, ins, outs):
    src = node.args[0].meta.get("val")
    producer = signature(node.args[0]) if isinstance(src, (tuple, list)) else None
    letters = producer.outputs[node.args[1]] if producer and node.args[1] < len(producer.outputs) else None
    if letters is None or len(letters) != len(outs[0]):
        letters = string.ascii_lowercase[: len(outs[0])]
    return Signature([letters], [letters], FOLLOWER, view=True)


def _reduction(node, ins, outs, linear: bool):
    src = ins[0]
    letters = string.ascii_lowercase[: len(src)]
    dims = _arg(node, "dim", None)
    if dims is None or dims == []:
        dims = list(range(len(src)))
    dims = {d % len(src) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keepdim = bool(_arg(node, "keepdim", False))
    out = "".join(("Q" if keepdim else "") if i in dims else c for i, c in enumerate(letters))
    return Signature(_place(node, ins, {0: letters}), [out] + [out] * (len(outs) - 1), FOLLOWER, linear=linear)


@rule(aten.sum, aten.mean)
def _sum(node, ins, outs):
    return _reduction(node, ins, outs, True)


@rule(aten.amax, aten.amin, aten.max, aten.min, aten.argmax, aten.argmin, aten.var, aten.std)
def _max(node, ins, outs):
    return _reduction(node, ins, outs, False)


@rule(aten.cumsum, aten.cumprod)
def _along(node, ins, outs):
    """cumsum and friends: one dim is scanned, the others carry through."""
    args = _args(node)
    letters = string.ascii_lowercase[: len(ins[0])]
    d = args[1] % len(letters)
    return Signature(_place(node, ins, {0: letters}), [letters[:d] + "Z" + letters[d + 1:]], FOLLOWER)


@rule(aten.pad, aten.constant_pad_nd)
def _pad(node, ins, outs):
    """Padding (Swin pads its feature map to whole windows): an unpadded dim carries through."""
    src, dst = ins[0], outs[0]
    if src is None or len(src) != len(dst):
        return None
    letters, own = string.ascii_lowercase[: len(src)], iter(string.ascii_uppercase)
    out = "".join(c if src[i] == dst[i] else next(own) for i, c in enumerate(letters))
    return Signature(_place(node, ins, {0: letters}), [out], FOLLOWER)


@rule(aten.roll, aten.flip)
def _roll(node, ins, outs):
    """roll / flip along some dims (Swin's shifted windows): the others carry through."""
    src = ins[0]
    dims = _arg(node, "dims", [])
    dims = {d % len(src) for d in (dims if isinstance(dims, (list, tuple)) else [dims])} if src else set()
    if not dims:  # roll without dims: over the flattened tensor
        dims = set(range(len(src)))
    letters, own = string.ascii_lowercase[: len(src)], iter(string.ascii_uppercase)
    out = "".join(next(own) if i in dims else c for i, c in enumerate(letters))
    return Signature(_place(node, ins, {0: letters}), [out], FOLLOWER)


@rule(aten.repeat)
def _repeat(node, ins, outs):
    """`x.repeat(r...)` tiles x: a dim repeated once carries through; a tiled or new one is new."""
    src, dst = ins[0], outs[0]
    reps = list(_args(node)[1])
    lead = len(dst) - len(src)
    letters, own = string.ascii_lowercase[: len(src)], iter(string.ascii_uppercase)
    out = "".join(letters[j - lead] if j >= lead and reps[j] == 1 else next(own) for j in range(len(dst)))
    return Signature(_place(node, ins, {0: letters}), [out], FOLLOWER)


@rule(aten.gather)
def _gather(node, ins, outs):
    """`gather(x, dim, index)`: the output has the index's shape, and along every other dim reads
    x at the index's position (RoBERTa's token types: a buffer expanded to the batch, gathered at
    each sample's positions), so those dims carry through where x has the index's size."""
    args = _args(node)
    x, index = _shape(args[0].meta["val"]), _shape(args[2].meta["val"])
    if x is None or index is None or len(x) != len(index) or not x:
        return None
    d = args[1] % len(x)
    letters = string.ascii_lowercase[: len(index)]
    own = iter(string.ascii_uppercase)
    xl = "".join(next(own) if i == d or x[i] != index[i] else c for i, c in enumerate(letters))
    assign = {_input_index(node, args[0]): xl, _input_index(node, args[2]): letters}
    return Signature(_place(node, ins, assign), [letters], FOLLOWER)


@rule(aten.index)
def _index(node, ins, outs):
    """`x[i, j]` with index tensors on x's leading dims (CLIP's pooled token,
    `hidden[arange(b), eos]`): the output's leading dims are the indices' broadcast shape and carry
    their letters (a batch among them: the data axis splits it); x's dims keep letters of their
    own (its sharding on the tensor axis is not carried through the gather)."""
    args = _args(node)
    indices = list(args[1]) if isinstance(args[1], (list, tuple)) else []
    last = max((i for i, t in enumerate(indices) if isinstance(t, fx.Node)), default=-1)
    if last < 0 or any(not isinstance(t, fx.Node) for t in indices[: last + 1]) or len(outs) != 1:
        return None
    shapes = [_shape(t.meta.get("val")) for t in indices]
    if any(s is None for s in shapes):
        return None
    width = max(len(s) for s in shapes)
    if len(outs[0]) < width:
        return None
    letters, own = string.ascii_lowercase[:width], iter(string.ascii_uppercase)
    out = [d for d in outs[0][:width]]
    assign = {}
    for t, shape in zip(indices, shapes):
        lead = width - len(shape)
        assign[_input_index(node, t)] = "".join(letters[lead + i] if n == out[lead + i] else next(own)
                                                for i, n in enumerate(shape))
    x = _input_index(node, args[0])
    assign[x] = "".join(next(own) for _ in ins[x])
    rest = "".join(next(own) for _ in outs[0][width:])
    return Signature(_place(node, ins, assign), [letters + rest], FOLLOWER)


@rule(aten.max_pool1d, aten.max_pool1d_with_indices, aten.avg_pool1d, aten.adaptive_avg_pool1d,
      aten.adaptive_max_pool1d, aten.max_pool2d, aten.max_pool2d_with_indices, aten.avg_pool2d,
      aten.adaptive_avg_pool2d, aten._adaptive_avg_pool2d, aten.adaptive_max_pool2d, aten.max_pool3d,
      aten.avg_pool3d, aten.adaptive_avg_pool3d, aten._adaptive_avg_pool3d)
def _pool(node, ins, outs):
    """Pooling (1-, 2- or 3-d: Swin pools its tokens in 1-d): batch and channels carry through,
    the window's dims do not."""
    src = ins[0]
    letters = string.ascii_lowercase[: len(src)]
    spatial = int(next((c for c in str(node.target.overloadpacket) if c in "123"), "2"))
    lead = len(src) - spatial
    out = letters[:lead] + "XYZ"[:spatial]
    return Signature(_place(node, ins, {0: letters}), [out] * len(outs), FOLLOWER)


@rule(aten.cat, aten.stack)
def _cat(node, ins, outs):
    args = _args(node)
    rank = len(outs[0])
    d = (args[1] if len(args) > 1 and isinstance(args[1], int) else 0) % rank
    letters = string.ascii_lowercase[:rank]
    shared = letters[:d] + "Z" + letters[d + 1:]
    if node.target == aten.stack.default:
        shared = letters[:d] + letters[d + 1:]
    placed = [shared if s is not None else None for s in ins]
    return Signature(placed, [letters[:d] + "Y" + letters[d + 1:]], FOLLOWER)




def letter_sizes(sig: Signature, ins: list, outs: list) -> dict[str, int]:
    """Size of each letter (a letter present in several tensors has one size, or it is not splittable)."""
    sizes: dict[str, int] = {}
    for letters, shape in [*zip(sig.inputs, ins), *zip(sig.outputs, outs)]:
        if letters is None or shape is None:
            continue
        for c, n in zip(letters, shape):
            sizes[c] = math.gcd(sizes[c], n) if c in sizes else n
    return sizes
