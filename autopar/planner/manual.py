"""Hand-written 3D layouts, the way Megatron-LM lays a model out, as Plans (and DeepSpeed-MoE's).

(dp, tp, pp, microbatches): transformer blocks split evenly over pp stages (embedding on the
first, output layer on the last; with v stages per device group, over pp·v stages, Megatron-LM's
interleaved layout), tensor parallelism inside a host with Megatron's column- and
row-parallel linears, vocabulary-parallel embeddings and attention split by heads, data
parallelism outermost, no ZeRO. The sharding is the intra-op ILP constrained to those choices,
so it is priced, simulated and run exactly like a searched plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.contract import schedules
from autopar.contract.compat import Features, refusal
from autopar.contract.errors import AutoparError
from autopar.contract.placements import Replicate
from autopar.contract.plan import SELECTIVE, Plan, StagePlan
from autopar.planner import rules as L
from autopar.planner.graph import OpNode
from autopar.planner.inter_op import microbatch_counts
from autopar.planner.layering import Layer, modules
from autopar.planner.search import Search, assemble
from autopar.planner.stage_costs import StageCosts
from autopar.planner.strategy_costs import Rule


def megatron_letters(sig: L.Signature, node: OpNode, batch: set[str]) -> set[str | None]:
    """Megatron-LM's tensor parallelism: which letter each kind of op may split."""
    op = node.op.removeprefix("aten.").rsplit(".", 1)[0]
    if op in ("linear", "addmm", "mm", "matmul", "bmm"):
        # column- or row-parallel; the ILP alternates them to save all-reduces (never a batch:
        # CLIP's image-text similarities multiply the batch by the batch)
        return ({"n", "k"} - batch) or {None}
    if op == "embedding":  # vocabulary-parallel where it looks the data's tokens up; a table read
        # by positions (no batch) stays whole, as Megatron-LM's position embeddings do
        return {"v"} if batch else {None}
    if "scaled_dot_product" in op:
        return {"h"}  # attention heads
    if op in ("conv2d", "convolution"):
        return {"o", "c"}
    if op == "einsum" or "grouped_mm" in op:
        return (set(sig.shardable) - batch) or {None}  # expert and hidden dimensions of MoE layers
    return {None}


MEGATRON = Rule(letters=megatron_letters, zero=False)


def megatron_sp_letters(sig: L.Signature, node: OpNode, batch: set[str]) -> set[str | None]:
    """Megatron-LM with --sequence-parallel (Korthikanti et al., 2022): norms split the sequence as
    well; the row-parallel linears' partial sums are reduce-scattered onto it (`Rule.sequence_parallel`)."""
    if node.op.removeprefix("aten.").rsplit(".", 1)[0] in ("layer_norm", "native_layer_norm", "rms_norm"):
        return (set(sig.shardable) - batch) or {None}
    return megatron_letters(sig, node, batch)


MEGATRON_SP = Rule(letters=megatron_sp_letters, zero=False, sequence_parallel=True)


def deepspeed_moe_letters(sig: L.Signature, node: OpNode, batch: set[str]) -> set[str | None]:
    """DeepSpeed-MoE: every device is a data-parallel rank, and expert weights are spread over them.

    An expert weight's own dimension is the letter shared by all of an op's inputs and its output
    that is not the batch (`e` in `egcm,emh->egch`): such ops split it (expert parallelism, tokens
    arrive by all-to-all); every other op splits its batch."""
    inputs = [set(x) for x in sig.inputs if x]
    shared = set.intersection(*inputs, set("".join(sig.outputs))) if inputs else set()
    experts = (shared - batch) & set(sig.shardable) if node.params else set()
    return experts or (batch & set(sig.shardable)) or {None}


DEEPSPEED_MOE = Rule(letters=deepspeed_moe_letters, zero=False, shard_states=True)
DEEPSPEED_MOE_NAME = "deepspeed-moe"


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    num_microbatches: int | None = None
    recompute: bool | str = False  # True: whole layers; SELECTIVE: attention cores only
    virtual: int = 1  # stages per device group
    sequence_parallel: bool = False  # Megatron-LM's --sequence-parallel (`MEGATRON_SP`)
    zero: int = 0  # ZeRO-1/2 of every stage (Megatron-LM's --use-distributed-optimizer is ZeRO-1); 3: every
    # weight also sharded over the data axis (FSDP's full sharding: `manual_search(zero3=True)`)
    offload: bool = False  # with `zero`: the shards in host memory (FSDP2's CPUOffloadPolicy)

    @property
    def name(self) -> str:
        mb = f",{self.num_microbatches}" if self.num_microbatches else ""
        return (f"megatron-{self.dp},{self.tp},{self.pp}{mb}" + (f"+v{self.virtual}" if self.virtual > 1 else "")
                + ("+sp" if self.sequence_parallel else "") + (f"+z{self.zero}" if self.zero else "")
                + ("+offload" if self.offload else "")
                + ("+selective" if self.recompute == SELECTIVE else "+recompute" if self.recompute else ""))

    @property
    def zero_choice(self) -> int:
        """The ZeRO level as the planner's variants spell it (negative: offloaded); ZeRO-3 is the
        sharding rule's, not a stage variant's."""
        if self.zero == 3:
            return 0
        return -self.zero if self.offload else self.zero

    @staticmethod
    def parse(text: str, recompute: bool | str = False, virtual: int = 1, sequence_parallel: bool = False,
              zero: int = 0, offload: bool = False) -> Layout:
        """DP,TP,PP[,MICROBATCHES], then "+sp" for sequence parallelism, "+z1" / "+z2" / "+z3" for
        ZeRO-1/2/3, "+offload" for ZeRO-1/2's shards in host memory, "+recompute" / "+selective"
        for recomputation of whole layers / of attention only."""
        body, *flags = text.split("+")
        try:
            parts = [int(p) for p in body.split(",")]
        except ValueError:
            parts = []
        zeros = {"z1", "z2", "z3"} & set(flags)
        if len(parts) not in (3, 4) or any(p < 1 for p in parts) or not set(flags) <= {"sp", "offload", "recompute", "selective"} | zeros \
                or len(set(flags)) < len(flags) or len(zeros) > 1 or {"recompute", "selective"} <= set(flags):
            raise AutoparError(f"malformed layout {text!r}: write DP,TP,PP or DP,TP,PP,MICROBATCHES, e.g. 2,4,8,64, "
                               "then +sp for sequence parallelism, +z1, +z2 or +z3 for ZeRO-1/2/3, +offload for ZeRO-1/2's "
                               "shards in host memory and +recompute or +selective for recomputation of whole layers "
                               "or of attention only (e.g. 8,1,1+z2+offload)")
        zero = next((int(f[1]) for f in flags if f.startswith("z")), zero)
        recompute = SELECTIVE if "selective" in flags else recompute or "recompute" in flags
        return Layout(*parts[:3], parts[3] if len(parts) == 4 else None, recompute, virtual,
                      sequence_parallel or "sp" in flags, zero, offload or "offload" in flags)


def manual_search(search: Search, zero3: bool = False, sequence_parallel: bool = False) -> Search:
    """The same graph and cluster with Megatron's sharding rule (with `zero3`, every weight also
    sharded over the data axis, as FSDP does; with `sequence_parallel`, Megatron-SP); layers are the
    model's modules. A hand-written layout names its schedule: "auto" (the search's) prices it with 1F1B."""
    layers = module_layers(search)
    rule = MEGATRON_SP if sequence_parallel else MEGATRON
    rule = dataclasses.replace(rule, zero=True, zero_only=True) if zero3 else rule
    c = search.costs
    costs = StageCosts(search.graph, search.cluster, rule, c.time_limit_s, c.compression, world=c.world,
                       choices=c.choices, pin=c.pin)
    return Search(search.workload, search.cluster, search.mesh, search.graph, layers, costs,
                  search.memory_limit, "1f1b" if search.schedule == "auto" else search.schedule, search.virtual)


def module_layers(search: Search) -> list[Layer]:
    """The graph's modules as layers, where a person cuts stages."""
    return modules(search.graph)


def blocks(search: Search, stages: int) -> list[int]:
    """Indices of the layers that begin a Megatron block: the layers of the most common structure
    with FLOPs (GPT's blocks; GShard's dense-and-MoE pairs begin at the first kind). A model with
    several stacks of blocks (`ModuleList`s: an encoder and a decoder) splits each stack every p
    layers, p the period of its structure; a stack's first block may differ from the rest (T5's
    holds the relative-position bias). A stack whose blocks all differ (a ResNet's) splits by them.
    Where those blocks do not split evenly into `stages`, the stack with the most FLOPs splits by
    its own (DeepSeek-V3's dense first block and three MoE ones: four blocks; MobileNetV2's
    inverted residuals of every width), if they do."""
    common = _common_blocks(search)
    stacks = _stacks(search)
    if len(common) % stages and stacks:
        stack = max(stacks.values(), key=lambda s: sum(search.layers[i].flops for i in s))
        period = _period([search.costs.hashes[i] for i in stack])
        own = stack[::period] if period < len(stack) else stack
        if not len(own) % stages:
            return own
    return common


def _stacks(search: Search) -> dict[str, list[int]]:
    """The layers with FLOPs of each `ModuleList` of blocks, by its path."""
    stacks: dict[str, list[int]] = {}
    for i, layer in enumerate(search.layers):
        prefix, _, index = layer.name.rpartition(".")
        if layer.flops > 0 and prefix and index.isdigit():
            stacks.setdefault(prefix, []).append(i)
    return stacks


def _common_blocks(search: Search) -> list[int]:
    hashes = search.costs.hashes
    heavy = [i for i, layer in enumerate(search.layers) if layer.flops > 0]
    stacks = _stacks(search)
    if len(stacks) > 1:
        return [i for stack in stacks.values() for i in stack[::_period([hashes[i] for i in stack])]]
    kinds = list(dict.fromkeys(hashes[i] for i in heavy))  # first appearance breaks ties (MoE: the MoE block)
    common = max(kinds, key=lambda h: sum(hashes[i] == h for i in heavy))
    alike = [i for i in heavy if hashes[i] == common]
    if len(alike) == 1 and stacks:  # blocks that all differ (a ResNet's widening ones): the stack's own
        stack = next(iter(stacks.values()))
        return stack[::_period([hashes[i] for i in stack])]
    return alike


def _period(kinds: list) -> int:
    """The smallest p dividing len(kinds) with kinds[i] == kinds[i - p] for every i - p ≥ 1."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i - p] for i in range(p + 1, n)))


def check(search: Search, layout: Layout) -> str | None:
    """Why a layout is not valid for this model and mesh, or None."""
    hosts, per_host = search.mesh
    block = blocks(search, layout.pp * layout.virtual)
    if layout.dp * layout.tp * layout.pp != hosts * per_host:
        return f"dp × tp × pp = {layout.dp * layout.tp * layout.pp}, the mesh has {hosts * per_host} devices"
    if layout.tp > per_host or per_host % layout.tp:
        return f"tensor parallelism {layout.tp} must divide the {per_host} devices of a host"
    if (layout.dp * layout.tp) % per_host and per_host % (layout.dp * layout.tp):
        return f"a stage's {layout.dp * layout.tp} devices must tile hosts of {per_host}"
    stages = layout.pp * layout.virtual
    compression = search.costs.compression
    why = refusal(Features(schedule=search.schedule, stages=stages, virtual=layout.virtual, dp=layout.dp, tp=layout.tp,
                           zero=layout.zero, offload=layout.offload, recompute=layout.recompute,
                           sequence_parallel=layout.sequence_parallel,
                           compression=compression.canonical() if compression is not None else None,
                           precision=search.graph.precision))
    if why:
        return why
    if layout.recompute == SELECTIVE and not any(n.attention for n in search.graph):
        return "selective recomputation recomputes attention (QKᵀ, softmax, the product with V): the model has none"
    if len(block) % stages:
        return (f"{len(block)} blocks do not split evenly into {stages} stages" + (
            ": its repeated layers form one block (layers that share one block's weights, as ALBERT's do, "
            "run as one layer of the graph)" if len(block) == 1 else ""))
    batch = search.workload.batch
    if batch % layout.dp:
        return f"data parallelism {layout.dp} does not divide the batch {batch}"
    if layout.num_microbatches and (batch % layout.num_microbatches or (batch // layout.num_microbatches) % layout.dp):
        return f"batch {batch} does not split into {layout.num_microbatches} microbatches of a multiple of {layout.dp}"
    fewest = layout.num_microbatches or 1  # without a count, the fewest microbatches hold the most samples
    if not search.costs.splits_batch(fewest, layout.dp):
        needs = search.costs.needs
        return (f"a rank's microbatch would hold {batch // fewest // layout.dp} sample(s); the model needs "
                + (f"a multiple of {needs.group}" if needs.group > 1 else f"at least {needs.fewest}")
                + f" ({needs.why}): use "
                + ("fewer microbatches" if layout.num_microbatches else "a larger batch or less data parallelism"))
    # without a microbatch count, only counts the schedule runs are tried (one round: any runs)
    return schedules.problem(search.schedule, layout.pp, layout.num_microbatches or layout.pp, layout.virtual)


def manual_plan(search: Search, layout: Layout) -> Plan:
    """The Plan of a hand-written layout (its best microbatch count when none is given)."""
    why = check(search, layout)
    if why:
        raise AutoparError(f"layout {layout.name} is not valid for {search.workload.name} on "
                           f"{search.mesh[0]}x{search.mesh[1]}: {why}")
    hosts, per_host = search.mesh
    size = layout.dp * layout.tp
    shape = (1, size) if size <= per_host else (size // per_host, per_host)
    if layout.virtual != search.virtual:
        search = dataclasses.replace(search, virtual=layout.virtual)
    rule = search.costs.rule
    if rule is not None and (layout.sequence_parallel != rule.sequence_parallel or layout.zero == 3 and not rule.zero_only):
        search = manual_search(search, rule.zero_only or layout.zero == 3, layout.sequence_parallel)
    cuts, counts = stage_cuts(search, layout), layout_counts(search, layout)
    best = None
    for m in counts:
        chosen = []
        for s, (i, j) in enumerate(zip(cuts, cuts[1:])):
            option = search.fastest(i, j, shape, m, *search.budget(s, len(cuts) - 1, m), logical=[(layout.dp, layout.tp)],
                                    recompute=(layout.recompute,), zeros=(layout.zero_choice,)) \
                or _unconstrained(search, i, j, shape, m, layout)
            chosen.append(((i, j), shape, option))
        if any(opt is None for _, _, opt in chosen):
            continue
        plan = assemble(search, chosen, m, name=layout.name)
        # ascending counts: a tie (to rounding) keeps the fewer microbatches, which cost less than priced
        if best is None or (plan.estimate.fits, -plan.estimate.step_time_s) > (
                best.estimate.fits, -best.estimate.step_time_s * (1 - 1e-9)):
            best = plan
    if best is None and not counts:
        raise AutoparError(f"layout {layout.name}: no microbatch count splits the batch {search.workload.batch}")
    if best is None:
        raise AutoparError(f"layout {layout.name}: some layer cannot run on the logical mesh ({layout.dp}, {layout.tp}) "
                           f"(the data axis must divide every batch dimension); `autopar plan --stages 1` names the op")
    return best


def stage_cuts(search: Search, layout: Layout) -> list[int]:
    """Where the layout's stages begin (Megatron's blocks split evenly), and the end."""
    stages = layout.pp * layout.virtual
    block = blocks(search, stages)
    per_stage = len(block) // stages
    return [0] + [block[per_stage * s] for s in range(1, stages)] + [len(search.layers)]


def layout_counts(search: Search, layout: Layout) -> list[int]:
    """The microbatch counts the layout is priced with (its own, or every one the batch and the
    schedule allow), ascending."""
    return [layout.num_microbatches] if layout.num_microbatches else [
        m for m in microbatch_counts(search.workload.batch) if search.costs.splits_batch(m, layout.dp)
        and not schedules.problem(search.schedule, layout.pp, m, layout.virtual)]


def _unconstrained(search: Search, i: int, j: int, shape, m: int, layout: Layout):
    """A layout that does not fit is still priced (reported as not fitting), never dropped silently."""
    opts = search.costs.options(search.atoms(i, j), shape, m, [(layout.dp, layout.tp)], (layout.recompute,),
                                (layout.zero_choice,))
    return min((o for o in opts if not o.lean), key=lambda o: o.time, default=None)


def layout_grid(search: Search, recompute: tuple[bool, ...] = (False, True)) -> list[Layout]:
    """Every valid (dp, tp, pp), with and without recomputation (microbatches searched per layout)."""
    hosts, per_host = search.mesh
    devices = hosts * per_host
    out = []
    for tp in (t for t in range(1, per_host + 1) if per_host % t == 0):
        for pp in (p for p in range(1, devices // tp + 1) if (devices // tp) % p == 0):
            for rc in recompute:
                layout = Layout(devices // (tp * pp), tp, pp, None, rc)
                if check(search, layout) is None:
                    out.append(layout)
    return out


def has_experts(search: Search) -> bool:
    """Whether some op computes with a weight that has an expert dimension (an MoE model)."""
    g = search.graph
    for node in g:
        fx_node = g.fx_nodes.get(node.name)
        if node.params and fx_node is not None and "einsum" in node.op:
            sig = L.signature(fx_node)
            inputs = [set(x) for x in sig.inputs if x]
            if inputs and set.intersection(*inputs, set("".join(sig.outputs))):
                return True
    return False


def deepspeed_moe_plan(search: Search) -> Plan:
    """The layout Alpa compared its MoE results against: DeepSpeed's ZeRO-2 data parallelism over
    every device with the experts spread over all of them (one stage, no tensor or pipeline
    parallelism), priced by the same cost model as every other plan."""
    hosts, per_host = search.mesh
    devices = hosts * per_host
    costs = StageCosts(search.graph, search.cluster, DEEPSPEED_MOE, search.costs.time_limit_s, world=search.costs.world)
    view = Search(search.workload, search.cluster, search.mesh, search.graph, search.layers, costs,
                  search.memory_limit, units=search.units)  # one stage: no pipeline schedule
    n, batch = len(view.layers), search.workload.batch
    best = None
    for m in (m for m in microbatch_counts(batch) if (batch // m) % devices == 0):
        option = view.stage_table(0, n, search.mesh, m, 1, logical=[(1, devices)], recompute=(False,))[1]
        if option is None:
            opts = costs.options(view.atoms(0, n), search.mesh, m, [(1, devices)], (False,))
            option = min(opts, key=lambda o: o.time, default=None)  # priced, reported as not fitting
        if option is None:
            continue
        plan = assemble(view, [((0, n), search.mesh, option)], m, name=DEEPSPEED_MOE_NAME)
        # ascending counts: a tie (to rounding) keeps the fewer microbatches, which cost less than priced
        if best is None or (plan.estimate.fits, -plan.estimate.step_time_s) > (
                best.estimate.fits, -best.estimate.step_time_s * (1 - 1e-9)):
            best = plan
    if best is None:
        raise AutoparError(f"{DEEPSPEED_MOE_NAME}: the batch {batch} does not split over {devices} devices")
    return best


def uncaptured_plan(model: str, params: list[str], batch: int, world: int, mesh: tuple[int, int], cluster: str,
                    layout: Layout | None, why: str, precision: str | None = None) -> Plan:
    """Plain data parallelism for a model `torch.export` cannot capture (a Python loop over a
    data-dependent count, say): every rank runs the whole model eagerly on its samples and the
    gradients are averaged, as DDP does. It needs no graph, and nothing is priced: there is none.
    A layout asking for more than data parallelism (and microbatches) needs the graph: refused."""
    if layout is not None and (layout.tp, layout.pp, layout.dp) != (1, 1, world) or layout is not None and (
            layout.recompute or layout.zero or layout.sequence_parallel or layout.virtual > 1):
        raise AutoparError(f"layout {layout.name} needs the model's graph: {why}\n  without it only plain data "
                           f"parallelism ({world},1,1[,MB]) runs")
    m = layout.num_microbatches if layout is not None and layout.num_microbatches else 1
    if batch % (world * m):
        raise AutoparError(f"batch {batch} does not split into {world} ranks × {m} microbatches")
    stage = StagePlan(layers=(0, 1), submesh=mesh, logical_mesh=(world, 1),
                      params={fqn: [Replicate(), Replicate()] for fqn in params})
    return Plan(model=model, graph_hash="", batch=batch, cluster=cluster, mesh=mesh,
                layers=[{"name": "", "nodes": []}], stages=[stage], num_microbatches=m, name=f"uncaptured-{world},1,1",
                precision=precision, search={"uncaptured": True})
