"""What each sharding choice of an anchor group costs: the tensor-axis letters an anchor may split
(with ZeRO-3 or not on the data axis), the placements that choice gives its followers, and per
choice the compute, in-op collectives, gradient synchronisation and memory."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.contract.precision import PRECISIONS
from autopar.cost_models import (
    ClusterSpec,
    collective_time,
    compute_time,
    fixed_time,
    model_state_memory,
    optimizer_time,
)
from autopar.planner import rules as L
from autopar.planner.graph import OpGraph, OpNode
from autopar.planner.placement import P, R, edge_time, redistribution, shard, shard_dim
from autopar.planner.stage_graph import StageGraph

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Rule:
    """A layout convention as a constraint: which letters an anchor may split (None: replicated)."""

    # (signature, op, its batch letters) -> the letters allowed; None: any
    letters: Callable[[L.Signature, OpNode, set[str]], set[str | None]] | None
    zero: bool = True  # whether ZeRO-3 may be chosen on the data axis
    zero_only: bool = False  # ZeRO-3 wherever it may be: every weight sharded over the data axis (FSDP)
    # ZeRO-2 along the tensor axis: a weight replicated on it, whose gradient it all-reduces (the
    # axis is data-parallel for that weight, as in DeepSpeed-MoE), keeps 1/tp of its gradient
    # and optimizer state; the all-reduce becomes reduce-scatter + all-gather, the same bytes.
    # Only layouts priced for comparison set it (DeepSpeed-MoE): the runtime does not shard those
    # states, so the searches that plan runs (no rule, `REPLICATED_GRADIENTS`) do not promise it
    shard_states: bool = False
    # Megatron-LM's --sequence-parallel (Korthikanti et al., 2022) as a constraint: where the tensor
    # axis leaves a partial sum (row-parallel), it is always reduce-scattered onto the first
    # dimension the ops after it can run split on (`Strategy.scatter`). Without it the free search
    # weighs every such dimension and the all-reduce, and picks
    sequence_parallel: bool = False


# the free search with gradients replicated on the data axis, which compressors need
REPLICATED_GRADIENTS = Rule(letters=None, zero=False)


@dataclass(frozen=True)
class Strategy:
    letter: str | None  # the letter the tensor axis splits (None: replicated on it)
    zero: bool  # parameters sharded on the data axis (ZeRO-3)
    shard_states: bool = False  # see Rule.shard_states
    # where the split leaves a partial sum: the dimension of the follower's input the sum is
    # reduce-scattered along (see Rule.sequence_parallel); None: all-reduced
    scatter: int | None = None


@dataclass
class Evaluation:
    """One strategy of one anchor group: placements of its nodes and what they cost."""

    out: dict[str, list[str]] = field(default_factory=dict)  # node -> tp placement per output
    need: dict[str, list[str | None]] = field(default_factory=dict)  # node -> tp placement it needs per input
    params: dict[str, str] = field(default_factory=dict)  # fqn -> tp placement
    compute: float = 0.0
    fixed: float = 0.0  # the part of `compute` that does not shrink with the batch: per op, per microbatch
    comm: float = 0.0
    grad_sync: float = 0.0
    state_memory: float = 0.0
    activation_memory: float = 0.0
    weight_copies: float = 0.0  # 16-bit copies of weights autocast makes, per microbatch (`autopar.planner.precision`)
    gathered: float = 0.0  # ZeRO-3: the whole parameters and their gradients during the step (FSDP2)
    zero_gather: float = 0.0  # ZeRO-3's all-gathers' bytes (forward and backward), part of `comm`: per microbatch
    zero_scatter: float = 0.0  # ZeRO-3's gradient reduce-scatter, again for every microbatch
    tp_grad: float = 0.0  # partial weight gradients all-reduced on the tensor axis, once per step after backward
    # the optimizer's step on ZeRO-3's parameters (FSDP2's DTensors: DTensor's dispatch per op) beyond
    # a plain parameter's, once per step: in the choice only, the stage's optimizer_s prices it whole
    optimizer: float = 0.0
    param_states: dict[str, float] = field(default_factory=dict)  # fqn -> its share of state_memory
    param_grads: dict[str, float] = field(default_factory=dict)  # fqn -> its gradient's part of that
    grad_memory: float = 0.0  # the gradients' part of state_memory (allocated by the step's first backward)
    # selective recomputation (`autopar.contract.attention`): what backward saves of the attention
    # cores' ops, the inputs a checkpoint of them keeps beyond that, and the cores' forward it runs again
    attention_memory: float = 0.0
    attention_kept: float = 0.0
    attention_s: float = 0.0
    # {node, kind, phase, bytes, axis[, unit | param | batch_free: True]}: `StageSharding.collectives`
    collectives: list[dict] = field(default_factory=list)
    letters: dict[str, str | None] = field(default_factory=dict)  # node -> the letter split on the tensor axis
    partial: dict[str, set[int]] = field(default_factory=dict)  # node -> inputs whose gradient the edge prices partial
    grads_partial: dict[str, set[int]] = field(default_factory=dict)  # node -> every value input whose gradient it leaves partial
    scattered: bool = False  # a partial sum was reduce-scattered (Strategy.scatter took effect)

    @property
    def time(self) -> float:
        return self.compute + self.comm + self.grad_sync + self.tp_grad + self.optimizer


def gathered_bytes(graph: OpGraph, fqn: str, shards: int) -> float:
    """What FSDP2 holds of a ZeRO-3 parameter while its unit is gathered: the whole parameter (in
    the run's precision), its unsharded gradient (same dtype) and the reduce-scatter's input
    buffer (the parameter's own dtype, fp32 under mixed precision); `shards`: its tensor-axis split."""
    info = graph.params[fqn]
    own = DTYPE_BYTES.get(info.dtype, 4)
    width = PRECISIONS[graph.precision].itemsize if graph.precision else own
    return math.prod(info.shape) / shards * (2 * width + own)


class StrategyCosts:
    """Each anchor group's strategies on one stage graph and mesh, evaluated one by one."""

    def __init__(self, g: StageGraph, cluster: ClusterSpec) -> None:
        self.g, self.graph, self.mesh, self.cluster = g, g.graph, g.mesh, cluster

    def strategies(self, anchor: str, rule: Rule | None = None) -> list[Strategy]:
        """The tensor-axis splits an anchor may take (narrowed by a layout rule), each with and
        without ZeRO-3 on the data axis when the group holds parameters. The batch is the data
        axis's: the shardings are solved at the whole batch, and a batch split on the tensor axis
        that divides the whole batch need not divide a microbatch (the runtime cannot run it), so
        the search's tensor axis splits other letters (or none). A layout rule that names its
        letters may still split the batch there (DeepSpeed-MoE's every-device data parallelism);
        `StageCosts.splits_microbatch` keeps such a stage to microbatches it divides."""
        sig = self.g.sig[anchor]
        letters: list[str | None] = [None]
        if sig.kind in (L.ANCHOR,) and self.mesh.tp > 1:
            sizes = self.g.sizes(anchor)
            batch_letters = self.g.batch_letters(anchor)
            for c in sorted(sig.shardable):
                if c in batch_letters and (rule is None or rule.letters is None):
                    continue
                n = self.mesh.tp * (self.mesh.dp if c in batch_letters else 1)
                if c in sizes and sizes[c] % n == 0 and sizes[c] >= n:
                    if any(c in o for o in sig.outputs) or sig.linear:
                        letters.append(c)
        if rule is not None and rule.letters is not None:
            allowed = rule.letters(sig, self.graph.node(anchor), self.g.batch_letters(anchor))
            letters = [c for c in letters if c in allowed] or [None]
        has_params = anchor in self.g.owning_groups
        zeros = [False, True] if has_params and self.mesh.dp > 1 and (rule is None or rule.zero) else [False]
        zeros = [True] if rule is not None and rule.zero_only and True in zeros else zeros
        states = rule is not None and rule.shard_states
        forced = rule is not None and rule.sequence_parallel
        return [Strategy(c, z, states, d) for c in letters for d in self._scatters(anchor, c, forced) for z in zeros]

    def _scatters(self, anchor: str, letter: str | None, forced: bool) -> list[int | None]:
        """The ways a split that leaves a partial sum may end: all-reduced (None), or reduce-scattered
        along each dimension the ops after it can run split on (each tried: the ILP picks). `forced`
        (Megatron-LM's --sequence-parallel): reduce-scattered along the first such dimension."""
        sig = self.g.sig[anchor]
        if letter is None or not sig.linear or any(letter in o for o in sig.outputs):
            return [None]
        ranks = {len(self.graph.node(m).outputs[0].shape) for m in self.g.members[anchor] if self.graph.node(m).outputs}
        kept = [d for d in range(max(ranks, default=0))
                if self.evaluate(anchor, Strategy(letter, False, scatter=d)).scattered]
        return kept[:1] if forced and kept else [None, *kept]

    def evaluate(self, anchor: str, strategy: Strategy) -> Evaluation:
        ev = Evaluation()
        for name in self.g.members[anchor]:
            if name == anchor:
                self._place_anchor(ev, name, strategy.letter)
            else:
                self._place_follower(ev, name, strategy.scatter)
            self._cost_node(ev, name, strategy)
        return ev

    def _place_anchor(self, ev: Evaluation, name: str, letter: str | None) -> None:
        sig = self.g.sig[name]
        ev.letters[name] = letter
        ev.need[name] = [self._placement_of(letter, ls) if ls is not None else None for ls in sig.inputs]
        ev.out[name] = [self._placement_of(letter, ls, partial=sig.linear) for ls in sig.outputs]

    @staticmethod
    def _placement_of(letter: str | None, letters: str, partial: bool = False) -> str:
        if letter is None:
            return R
        if letter in letters:
            return shard(letters.index(letter))
        return P if partial else R

    def _place_follower(self, ev: Evaluation, name: str, scatter: int | None = None) -> None:
        """Carry the primary input's placement through the follower's letters; resolve what cannot pass
        (a partial sum: reduce-scattered along `scatter` where the follower can run split on it)."""
        sig = self.g.sig[name]
        inputs = self.g.tensor_inputs(name)
        primary_i, primary = max(((i, s) for i, s in inputs if s and self.g.root.get(s) == self.g.root[name]
                                  and sig.inputs[i]), key=lambda t: self.g.lead_key(name, *t))
        have = ev.out[primary][self.g.out_index(name, primary)]
        letter = None
        ev.letters[name] = None
        if have == P and sig.view:
            ev.need[name] = [P if i == primary_i else None for i, _ in inputs]
            ev.out[name] = [P for _ in sig.outputs]
            return
        d = shard_dim(have)
        if d is not None:
            c = sig.inputs[primary_i][d]
            outs_with = [c in o for o in sig.outputs]
            if all(outs_with) and self.g.divisible(name, c):
                letter = c
            elif sig.linear and not any(outs_with):
                ev.need[name] = [have if i == primary_i else None for i, _ in inputs]
                ev.out[name] = [P for _ in sig.outputs]
                return
        if letter is None and have == P and scatter is not None:
            c = sig.inputs[primary_i][scatter] if scatter < len(sig.inputs[primary_i]) else None
            if (c is not None and all(c in o for o in sig.outputs) and c not in self.g.batch_letters(name)
                    and self.g.divisible(name, c)):
                nbytes, have = self.g.in_bytes(name, primary_i, primary), shard(scatter)
                ev.comm += edge_time(P, have, nbytes, self.mesh.tp, self.mesh.tp_link, self.g.grad(primary))
                self._record(ev, name, primary, P, have, nbytes)
                if self.g.grad(primary):
                    self._record(ev, name, primary, have, R, nbytes, "backward", move=f"{P}>{have}")
                letter, ev.scattered = c, True
        if letter is None and have != R:  # the placement cannot pass: gather or reduce first
            nbytes = self.g.in_bytes(name, primary_i, primary)
            ev.comm += edge_time(have, R, nbytes, self.mesh.tp, self.mesh.tp_link, self.g.grad(primary))
            self._record(ev, name, primary, have, R, nbytes)
        ev.letters[name] = letter
        ev.need[name] = [self._placement_of(letter, ls) if ls is not None else None for ls in sig.inputs]
        ev.need[name][primary_i] = have if letter is not None else R
        ev.out[name] = [self._placement_of(letter, ls) for ls in sig.outputs]

    def _record(self, ev: Evaluation, name: str, tensor: str, src: str, dst: str, nbytes: float,
                phase: str = "forward", move: str | None = None) -> None:
        """The collectives redistributing `name`'s input `tensor` from `src` to `dst` on the tensor
        axis (`move`: the forward redistribution this one goes with, `intra_op.distinct`)."""
        for kind, f in redistribution(src, dst, self.mesh.tp):
            ev.collectives.append(self.g.collective(name, kind.value, phase, nbytes * f, "tp", tensor,
                                                    move=move or f"{src}>{dst}"))

    def _cost_node(self, ev: Evaluation, name: str, strategy: Strategy) -> None:
        node, sig, mesh = self.graph.node(name), self.g.sig[name], self.mesh
        if node.op == "input" or sig.kind == L.NOOP:
            return
        split = any(shard_dim(p) is not None for p in ev.out[name]) or (P in ev.out[name] and not sig.view)
        tp_share = mesh.tp if split else 1
        batched = any(d is not None for d in self.g.batch[name]) or self.g.batch_letters(name)
        # every op runs on the rank's slice of the batch, ruled or not (a batch × batch product: of both)
        dp_share = max(self.g.dp_share(name), mesh.dp) if batched else 1
        # every op is issued forward and, when a gradient flows through it, again in backward; on
        # a sharded stage (split on the tensor axis, or reading split inputs) at its lowered program's cost
        ops = 1 + self.g.grad(name)
        sharded = mesh.tp > 1 and (split or any(p not in (None, R) for p in ev.need.get(name, ())))
        device = self.cluster.device
        dtype = node.outputs[0].dtype if node.outputs else "float32"
        matmuls = (1 + 2 * self.g.grad(name)) if node.flops_fwd and not node.is_view else 0  # and both gradients
        fixed = fixed_time(device, dtype, ops, matmuls, sharded)
        ev.fixed += 0.0 if device.asynchronous else fixed  # paid again by every microbatch
        if node.is_view:
            ev.compute += fixed
        else:
            ev.compute += compute_time((node.flops_fwd + node.flops_bwd) / (dp_share * tp_share),
                                       3 * (node.bytes_read + node.bytes_written) / (dp_share * tp_share),
                                       device, dtype, ops=ops, matmuls=matmuls, sharded=sharded)
            kept = 0.0
            for k, out in enumerate(node.outputs):  # what backward keeps of it (all, when unknown)
                shared = mesh.tp if shard_dim(ev.out[name][k]) is not None else 1
                if node.saved_outputs is None or k in node.saved_outputs:
                    kept += out.nbytes / (self.g.dp_share(name, k) * shared)
                elif k in node.attention_inputs:  # kept by a checkpointed attention core only
                    ev.attention_kept += out.nbytes / (self.g.dp_share(name, k) * shared)
            kept += (node.cast_bytes + node.saved_hidden) / (dp_share * tp_share)
            ev.activation_memory += kept
            if node.attention:
                ev.attention_memory += kept
                ev.attention_s += compute_time(node.flops_fwd / (dp_share * tp_share),
                                               (node.bytes_read + node.bytes_written) / (dp_share * tp_share),
                                               device, dtype, ops=1, matmuls=1 if node.flops_fwd else 0,
                                               sharded=sharded)
        letter, out_letters = ev.letters.get(name), "".join(sig.outputs)
        for i, src in self.g.tensor_inputs(name):
            if sig.inputs[i] is None:
                continue
            # the split letter is summed out of this input's gradient: its shards hold partial sums
            # (the output's letter, or one a linear op contracts from its other factors only: a
            # grouped matmul split by expert leaves each token's gradient on its expert's rank;
            # not a bias, which is added)
            partial = letter is not None and letter not in sig.inputs[i] and (
                letter in out_letters or sig.linear and i not in sig.addends)
            fqn, placement = self.g.param_input(name, i, ev.need[name][i] or R)
            if partial and fqn is None:
                ev.grads_partial.setdefault(name, set()).add(i)
            if fqn is not None:
                self._cost_param(ev, name, fqn, placement, strategy, partial)
            elif partial and self.g.root.get(src) is not None and src != self.g.primary(name):
                ev.partial.setdefault(name, set()).add(i)  # the edge prices it: it depends on src's placement
            elif partial and self.g.grad(src):
                nbytes = self.g.in_bytes(name, i, src)
                ev.comm += collective_time("all_reduce", nbytes, mesh.tp, mesh.tp_link) / self.g.sharers(src)
                if self.g.first_sharer(src, name):
                    ev.collectives.append(self.g.collective(name, "all_reduce", "backward", nbytes, "tp", src))

    def _cost_param(self, ev: Evaluation, name: str, fqn: str, placement: str, strategy: Strategy, partial: bool) -> None:
        """Model states and gradient synchronisation of one parameter.

        Every user whose split leaves the weight's gradient partial all-reduces it on the tensor axis,
        alone, once per step after the last backward (`sharded_graph.reduce_partial_grads`; `tp_grad`);
        the first user stores the weight and synchronises it on the data axis, in buckets (as DDP and
        FSDP do): a parameter pays the bandwidth of its bytes, the per-message latency is paid per
        bucket (`_bucket_latency`)."""
        ev.params[fqn] = placement
        info, mesh, zero = self.graph.params[fqn], self.mesh, strategy.zero
        shards = mesh.tp if shard_dim(placement) is not None else 1
        local = info.nbytes / shards
        dp_bw = mesh.dp_link.bandwidth_only()
        trainable = fqn in self.graph.trainable
        syncs = []
        if trainable and partial and mesh.tp > 1:
            ev.tp_grad += collective_time("all_reduce", local, mesh.tp, mesh.tp_link)
            ev.collectives.append(self.g.collective(name, "all_reduce", "gradient", local, "tp", param=True))
        if self.g.owner[fqn] == name:
            if trainable and mesh.dp > 1 and zero:  # ZeRO-3: gathered for every forward and backward, a
                # layer's weights in one collective (FSDP2's unit): their α once per stage solve (`_unit_latency`)
                for phase in ("forward", "backward"):
                    ev.comm += collective_time("all_gather", local, mesh.dp, dp_bw)
                    ev.collectives.append(self.g.collective(name, "all_gather", phase, local, "dp", unit=True))
                ev.zero_gather += 2 * collective_time("all_gather", local, mesh.dp, dp_bw)
                if mesh.tp == 1:  # (on a tensor axis every parameter is a DTensor already)
                    ev.optimizer += optimizer_time(0.0, 0.0, self.cluster.device, dtensors=1.0)
                ev.zero_scatter += collective_time("reduce_scatter", local, mesh.dp, dp_bw)
                syncs.append(("dp", "reduce_scatter", "gradient", mesh.dp, dp_bw))
            elif trainable and mesh.dp > 1:
                syncs.append(("dp", "all_reduce", "gradient", mesh.dp, dp_bw))
            numel = math.prod(info.shape) / shards
            stage, over = (3, mesh.dp) if zero else (0, mesh.dp)
            if strategy.shard_states and partial and mesh.tp > 1 and not zero:
                stage, over = 2, mesh.tp
            states = model_state_memory(numel, DTYPE_BYTES.get(info.dtype, 4), zero_stage=stage, dp=over)
            ev.param_states[fqn] = states.total if trainable else states.params
            ev.param_grads[fqn] = states.grads if trainable else 0.0
            ev.grad_memory += states.grads if trainable else 0.0
            ev.state_memory += ev.param_states[fqn]
            if trainable and mesh.dp > 1 and zero:
                ev.gathered += gathered_bytes(self.graph, fqn, shards)
        if self.graph.node(name).casts and not zero:  # ZeRO-3 gathers 16-bit weights: nothing to copy
            ev.weight_copies += local * PRECISIONS[self.graph.precision].itemsize / DTYPE_BYTES.get(info.dtype, 4)
        for axis, kind, phase, n, link in syncs:
            ev.grad_sync += collective_time(kind, local, n, link)
            ev.collectives.append(self.g.collective(name, kind, phase, local, axis))
