"""The Plan: the one contract between the planner and the runtime (`"schema": "autopar.plan/4"`).

Schema 2 adds `virtual`, the stages each device group holds (interleaved and V-shaped schedules):
`stages` lists all p·v stages in model order and the schedule says which group holds each
(`schedules.stage_ranks`); a stage's submesh is its group's. Schema 1 files (one stage per group)
load as plans with `virtual` 1. Schema 3 adds `units`: the layers where a unit of recomputation
and of ZeRO-3 begins, so that stages may be cut at finer layers than a recomputing stage
checkpoints at; schema 1 and 2 files load with every layer a unit of its own. Schema 4 adds
`dp_gradient.compressed`: the parameters whose gradients a compressor compresses (the cost model's
decision per tensor and bucket, `cost_models.compression.decide`); older files load with none listed
(null), which runs every weight matrix compressed, as they were priced.

Keyed by stable strings only (parameter FQNs, exported node names, layer names), so a plan
written by the planner, by the hand-written 3D generator or by a person runs the same way, and
round-trips through JSON byte for byte. Timings of the search itself are not part of the plan:
the same inputs give the same file.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.contract import schedules
from autopar.contract.compat import stages_refusal
from autopar.contract.compression import parse
from autopar.contract.errors import AutoparError
from autopar.contract.jsonio import load_file, loads, write_json
from autopar.contract.limits import MAX_BATCH, MAX_DEVICES, MAX_MICROBATCHES
from autopar.contract.placements import Partial, Placement, Shard, is_placement, placed, spelled
from autopar.contract.units import human_time, printable, span

SCHEMA = "autopar.plan/4"
SCHEMAS = ("autopar.plan/1", "autopar.plan/2", "autopar.plan/3", SCHEMA)  # what loads
# a stage's fields written only when set (older plans read the same)
_UNSET_LEFT_OUT = ("recompute_layers", "recompute_granularity", "zero", "offload", "collectives", "collectives_key")


class PlanError(AutoparError):
    """A plan file that is malformed, of another schema, or for another model or cluster."""


SELECTIVE = "selective"  # `StagePlan.recompute_granularity`: recompute attention cores only (`contract.attention`)


@dataclass
class StagePlan:
    layers: tuple[int, int]  # [start, end) in `Plan.layers`
    submesh: tuple[int, int]  # (hosts, devices per host)
    logical_mesh: tuple[int, int]  # (dp, tp)
    params: dict[str, list[Placement]] = field(default_factory=dict)  # FQN -> [placement on dp, on tp]
    ops: dict[str, list[Placement]] = field(default_factory=dict)  # node -> [placement on dp, on tp]
    # node -> the tensor-axis placement each input (fx `all_input_nodes` order) must have when the
    # op runs (None: not a tensor the op splits); the runtime redistributes to it. Stages with tp > 1
    needs: dict[str, list[Placement | None]] = field(default_factory=dict)
    recompute: bool = False
    # with `recompute`: only the stage's first this many units (`Plan.units`) recompute, the later
    # ones keep their activations (as many as memory needs: Mist, AdaPipe); None: every unit
    recompute_layers: int | None = None
    # with `recompute`: "selective" recomputes only each layer's attention cores (QKᵀ, softmax,
    # dropout, the product with V: `contract.attention`), Megatron-LM's --recompute-granularity
    # selective; None: whole layers ("full")
    recompute_granularity: str | None = None
    # ZeRO-1 / ZeRO-2 of the parameters replicated on the data axis (FSDP2 keeping them gathered from
    # the step's first forward to its last backward): 1 shards their optimizer states (and fp32
    # master), 2 their gradients too; None: neither. ZeRO-3 is written in `params` (S(0) on dp)
    zero: int | None = None
    # with `zero`: the sharded parameters, gradients and optimizer states live in host memory
    # (FSDP2's `CPUOffloadPolicy`), the optimizer steps there; the device holds the gathered
    # parameters (and ZeRO-1's whole gradients). None: on the device
    offload: bool | None = None
    cost: dict[str, float] = field(default_factory=dict)  # per microbatch and per step, itemised
    # the collectives the stage's lowered program must issue per microbatch (the tensor axis's,
    # forward and backward), priced from the stage's placements: {"node", "kind", "phase", "bytes"
    # each rank hands in}; the runtime checks its program against them (`runtime.lower.unplanned`).
    # None: not recorded (a plan from before they were), nothing to check
    collectives: list[dict[str, Any]] | None = None
    # what `collectives` was priced from (`Plan.record_key`): a plan edited after planning (its
    # placements, precision, recomputation, microbatches) keeps a record of another program, which
    # the runtime then does not check (`Plan.priced_collectives`)
    collectives_key: str | None = None

    @property
    def devices(self) -> int:
        return self.submesh[0] * self.submesh[1]


@dataclass
class Estimate:
    step_time_s: float
    tflops_per_device: float
    peak_memory_bytes: float
    bubble_fraction: float
    fits: bool = True


@dataclass
class Plan:
    """What the planner decided and the runtime runs: the model's layers, each stage's layer range,
    submesh, logical mesh and placements, the microbatches and schedule, the data axis's gradient
    options and the prediction; JSON through `save` and `load`."""

    model: str
    graph_hash: str
    batch: int
    cluster: str
    mesh: tuple[int, int]
    layers: list[dict[str, Any]]  # {"name": layer hint, "nodes": [exported node names]}
    stages: list[StagePlan]
    num_microbatches: int
    schedule: str = "1f1b"
    virtual: int = 1  # stages per device group (the schedule places them)
    precision: str | None = None  # mixed precision it was priced for ("bf16", "fp16"); None: the model's dtype
    # the data axis: ZeRO level, compressor (and the parameters it compresses: None, every weight
    # matrix), delayed averaging's delay
    dp_gradient: dict[str, Any] = field(default_factory=lambda: {"zero_stage": 0, "compression": None,
                                                                 "compressed": None, "delay": 0})
    estimate: Estimate | None = None
    search: dict[str, Any] = field(default_factory=dict)  # how it was found: "auto" / "manual", solves, hits
    name: str = "auto"
    # the layers a unit begins at: what a recomputing stage checkpoints (each unit's input kept, one
    # unit recomputed at a time) and ZeRO-3 gathers at once; a stage starting inside a unit begins a
    # unit of its own there. None: every layer is a unit
    units: list[int] | None = None

    def stage_units(self, stage: StagePlan) -> list[list[str]]:
        """The exported node names of each unit of `stage`, in order (its parts of the units it cuts)."""
        starts = _unit_starts(self.units, stage.layers)
        return [[n for k in range(a, b) for n in self.layers[k]["nodes"]]
                for a, b in zip(starts, [*starts[1:], stage.layers[1]])]

    def record_key(self, stage: StagePlan) -> str:
        """A digest of what a stage's record of collectives depends on: its placements, precision,
        recomputation (and the units it recomputes), ZeRO level and the microbatch's size."""
        what = {"precision": self.precision, "batch": self.batch, "microbatches": self.num_microbatches,
                "units": [len(unit) for unit in self.stage_units(stage)],
                "params": spelled(stage.params), "ops": spelled(stage.ops), "needs": spelled(stage.needs),
                **{k: getattr(stage, k) for k in ("layers", "logical_mesh", "recompute", "recompute_layers",
                                                  "recompute_granularity", "zero")}}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=list).encode()).hexdigest()[:16]

    def priced_collectives(self, stage: StagePlan) -> list[dict[str, Any]] | None:
        """The collectives the planner priced for `stage`, to check its program against; None where
        there is no record, or the stage was edited after planning (the record is of another program)."""
        if stage.collectives is None or stage.collectives_key != self.record_key(stage):
            return None
        return stage.collectives

    # ---- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stages"] = [{**{k: v for k, v in s.items() if k not in _UNSET_LEFT_OUT or v is not None},
                           "layers": list(s["layers"]), "submesh": list(s["submesh"]),
                           "logical_mesh": list(s["logical_mesh"]), "params": spelled(stage.params),
                           "ops": spelled(stage.ops), "needs": spelled(stage.needs)}
                          for s, stage in zip(data["stages"], self.stages)]
        data["mesh"] = list(self.mesh)
        return {"schema": SCHEMA, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically (the same plan gives the same bytes)."""
        write_json(path, self.to_dict())

    @staticmethod
    def load(path: str | Path) -> Plan:
        """Read and validate a plan file (older schemas too); `PlanError` says what is wrong in it."""
        return _parse(load_file(path, "plan file", PlanError), str(path))

    @staticmethod
    def from_json(text: str, source: str = "plan") -> Plan:
        try:
            data = loads(text, source)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        return _parse(data, source)

    def with_gradient(self, **choices: Any) -> Plan:
        """The plan with the caller's data-axis choices (`compression`, `delay`; `compressed`, which
        parameters the compressor takes) in `dp_gradient`, validated as a plan file is. Another
        compressor drops the list of the one before (None: every weight matrix) unless given."""
        data = self.to_dict()
        if choices.get("compression") != data["dp_gradient"].get("compression"):
            choices = {"compressed": None, **choices}
        data["dp_gradient"] = {**data["dp_gradient"], **choices}
        said = ", ".join(f"{k}={v!r}" for k, v in choices.items())
        return _parse(data, f"plan {self.name} with {said}")

    # ---- checks against what it will run on ------------------------------------------------

    def check_precision(self, precision: str | None) -> None:
        """The run trains in the precision the plan was priced for (its memory and time assume it)."""
        if precision != self.precision:
            said = {None: "the model's own dtype (fp32)"}
            raise PlanError(f"this plan was priced for {said.get(self.precision, self.precision)}, the run asks for "
                            f"{said.get(precision, precision)}: run it with --mixed-precision "
                            f"{self.precision or 'fp32'}, or re-plan with --mixed-precision {precision or 'fp32'}")

    def check_placements(self, graph: Any, param_shapes: dict[str, tuple[int, ...]]) -> None:
        """What a hand-edited plan of the right model can still get wrong: a placement beyond its
        tensor's dimensions, a partial sum stored as a parameter, a parameter placed nowhere or one
        the model lacks, an op that is not in the graph or sits in two stages. Placements a caller
        wrote as text ("S(0)") are typed here, so the runtime only ever sees typed ones."""
        covered, owner = set(), {}
        for i, s in enumerate(self.stages):
            where = f"stages[{i}]"
            try:
                s.params, s.ops, s.needs = placed(s.params), placed(s.ops), placed(s.needs)
            except ValueError as exc:
                raise PlanError(f"{where}: {exc}") from None
            for fqn, placement in s.params.items():
                if fqn not in param_shapes:
                    raise PlanError(f"{where}.params names {fqn!r}, which the model does not have")
                if any(isinstance(p, Partial) for p in placement):
                    raise PlanError(f"{where}.params[{fqn!r}] is {_spell(placement)}: a stored parameter is never a partial "
                                    "sum (P); use R or S(d)")
                _within(placement, len(param_shapes[fqn]), f"{where}.params[{fqn!r}]")
                covered.add(fqn)
            for name, placement in s.ops.items():
                if name in owner:
                    raise PlanError(f"{where}.ops[{name!r}]: the op is in stages[{owner[name]}] too")
                owner[name] = i
                if name not in graph.graph.nodes:
                    raise PlanError(f"{where}.ops names {name!r}, which the model's graph does not have")
                outputs = graph.node(name).outputs
                _within(placement, len(outputs[0].shape) if outputs else 0, f"{where}.ops[{name!r}]")
            for name, placements in s.needs.items():
                if name not in graph.graph.nodes:
                    raise PlanError(f"{where}.needs names {name!r}, which the model's graph does not have")
                inputs = graph.node(name).inputs
                for k, placement in enumerate(placements):
                    if placement is not None and k < len(inputs):
                        _within([placement], len(inputs[k].shape), f"{where}.needs[{name!r}][{k}]")
        used = {fqn for node in graph for fqn in node.params}
        missing = sorted(used - covered)
        if missing:
            raise PlanError(f"the plan places no {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''} "
                            f"({len(missing)} of the model's {len(used)} parameters): re-plan, or add them to a stage")

    def check_graph(self, graph_hash: str) -> None:
        if graph_hash != self.graph_hash:
            raise PlanError(
                f"this plan was made for another model or batch (graph {self.graph_hash}, this one is {graph_hash}): "
                f"re-plan with `autopar plan {self.model}`")

    @property
    def groups(self) -> int:
        """Device groups of the pipeline (its ranks, in torch's words)."""
        return len(self.stages) // self.virtual

    @property
    def stage_ranks(self) -> list[int]:
        """The device group of each stage."""
        return schedules.stage_ranks(self.schedule, self.groups, self.virtual)

    @property
    def group_devices(self) -> list[int]:
        """Devices of each group (its first stage's submesh: every schedule places stage r on group r)."""
        return [s.devices for s in self.stages[:self.groups]]

    @property
    def num_devices(self) -> int:
        return sum(self.group_devices)

    def summary(self) -> str:
        """A few readable lines: stages, meshes, microbatches, prediction."""
        lines = [f"{printable(self.name)} plan for {printable(self.model)} (batch {self.batch}) on {printable(self.cluster)} "
                 f"{self.mesh[0]}x{self.mesh[1]}: {len(self.stages)} stage(s), {self.num_microbatches} "
                 f"microbatch(es), {self.schedule}" + (f" with {self.virtual} stages per device group" if self.virtual > 1
                                                       else "") + (f", mixed precision {self.precision}" if self.precision else "")]
        for i, s in enumerate(self.stages):
            names = [printable(self.layers[k]["name"]) for k in range(*s.layers)]
            group = f" (device group {self.stage_ranks[i]})" if self.virtual > 1 else ""
            lines.append(f"  stage {i}: layers {s.layers[0]}–{s.layers[1] - 1} ({span(names)}) on {s.submesh[0]}x{s.submesh[1]} "
                         f"devices{group} as dp {s.logical_mesh[0]} × tp {s.logical_mesh[1]}"
                         + (f", recomputing the activations of its first {s.recompute_layers} unit(s)"
                            if s.recompute and s.recompute_layers else ", recomputing attention (selective)"
                            if s.recompute and s.recompute_granularity else ", recomputing activations" if s.recompute else "")
                         + (f", ZeRO-{s.zero} over dp" if s.zero else "")
                         + (", its sharded states in host memory" if s.offload else ""))
        text, listed = self.dp_gradient.get("compression"), self.dp_gradient.get("compressed")
        if text:
            trained = {f for s in self.stages for f in s.params}
            lines.append(f"  data axis: {printable(text)}, " + (
                "every weight matrix compressed" if listed is None else
                f"{len(listed)} of {len(trained)} parameters' gradients compressed (the others dense: "
                "too small, or cheaper dense on this link)"))
        if self.estimate:
            e = self.estimate
            lines.append(f"  predicted: {human_time(e.step_time_s)} per step, {e.tflops_per_device:.1f} TFLOP/s per "
                         f"device, peak {e.peak_memory_bytes / 2**30:.2f} GiB, bubble {e.bubble_fraction:.0%}"
                         + ("" if e.fits else " — DOES NOT FIT in memory"))
        return "\n".join(lines)


def _parse(data: Any, source: str) -> Plan:
    """Build a Plan from JSON data, naming the first thing that is wrong."""
    if not isinstance(data, dict):
        raise PlanError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if data.get("schema") not in SCHEMAS:
        raise PlanError(f"{source}: schema {data.get('schema')!r} is not one of {', '.join(SCHEMAS)}; re-plan with this "
                        "version of autopar")

    def need(obj: dict, key: str, kind: type | tuple, where: str = "") -> Any:
        value = obj.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise PlanError(f"{source}: {where}{key} must be {_kind(kind)}, got {value!r}")
        return value

    def pair(obj: dict, key: str, where: str) -> tuple[int, int]:
        value = need(obj, key, list, where)
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise PlanError(f"{source}: {where}{key} must be two non-negative integers, got {value!r}")
        return tuple(value)

    layers = need(data, "layers", list)
    for i, layer in enumerate(layers):
        if not (isinstance(layer, dict) and isinstance(layer.get("name"), str) and isinstance(layer.get("nodes"), list)
                and all(isinstance(n, str) for n in layer["nodes"])):
            raise PlanError(f"{source}: layers[{i}] must be {{\"name\": str, \"nodes\": [str, ...]}}, got {layer!r}")
    names = [n for layer in layers for n in layer["nodes"]]
    if len(set(names)) != len(names):
        twice = next(n for n, count in collections.Counter(names).items() if count > 1)
        raise PlanError(f"{source}: node {twice!r} is in more than one layer (or twice in one)")
    mesh = pair(data, "mesh", "")
    if mesh[0] * mesh[1] > MAX_DEVICES:
        raise PlanError(f"{source}: mesh {list(mesh)} has {mesh[0] * mesh[1]} devices, more than the {MAX_DEVICES} "
                        "autopar plans and runs")
    stages = []
    for i, s in enumerate(need(data, "stages", list)):
        where = f"stages[{i}]."
        if not isinstance(s, dict):
            raise PlanError(f"{source}: stages[{i}] must be an object")
        stage = StagePlan(
            layers=pair(s, "layers", where), submesh=pair(s, "submesh", where), logical_mesh=pair(s, "logical_mesh", where),
            params=need(s, "params", dict, where), ops=need(s, "ops", dict, where),
            recompute=need(s, "recompute", bool, where), cost=need(s, "cost", dict, where),
            needs=need(s, "needs", dict, where) if "needs" in s else {},
            recompute_layers=need(s, "recompute_layers", int, where) if s.get("recompute_layers") is not None else None,
            recompute_granularity=need(s, "recompute_granularity", str, where)
            if s.get("recompute_granularity") is not None else None,
            zero=need(s, "zero", int, where) if s.get("zero") is not None else None,
            offload=need(s, "offload", bool, where) if s.get("offload") is not None else None,
            collectives=need(s, "collectives", list, where) if s.get("collectives") is not None else None,
            collectives_key=need(s, "collectives_key", str, where) if s.get("collectives_key") is not None else None)
        for c in stage.collectives or ():
            if not (isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("node", "kind", "phase"))
                    and isinstance(c.get("bytes"), (int, float)) and not isinstance(c["bytes"], bool)
                    and math.isfinite(c["bytes"]) and c["bytes"] >= 0):
                raise PlanError(f"{source}: {where}collectives must be objects with node, kind and phase (strings) "
                                f"and bytes (a non-negative number), got {c!r}")
        if stage.zero is not None and not (stage.zero in (1, 2) and not any(p[0] == "S(0)" for p in stage.params.values())):
            raise PlanError(f"{source}: {where}zero must be 1 or 2 (null: none) on a stage whose parameters are not "
                            f"sharded over the data axis already (S(0): ZeRO-3), got {stage.zero!r}")
        if stage.recompute_granularity is not None and not (
                stage.recompute_granularity == SELECTIVE and stage.recompute and stage.recompute_layers is None):
            raise PlanError(f"{source}: {where}recompute_granularity must be \"selective\" (null: whole layers), with "
                            f"recompute true and recompute_layers null, got {stage.recompute_granularity!r}")
        for key, value in stage.cost.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise PlanError(f"{source}: {where}cost.{key} must be a finite number, got {value!r}")
        for kind, table in (("params", stage.params), ("ops", stage.ops)):
            for key, placement in table.items():
                if not (isinstance(placement, list) and len(placement) == 2
                        and all(is_placement(p) for p in placement)):
                    raise PlanError(f"{source}: {where}{kind}[{key!r}] must be two placements (R, P or S(d)), "
                                    f"got {placement!r}")
        for key, placements in stage.needs.items():
            if not (isinstance(placements, list)
                    and all(p is None or is_placement(p) for p in placements)):
                raise PlanError(f"{source}: {where}needs[{key!r}] must be a list of placements or null, got {placements!r}")
        stage.params, stage.ops, stage.needs = placed(stage.params), placed(stage.ops), placed(stage.needs)
        if stage.logical_mesh[0] * stage.logical_mesh[1] != stage.devices or stage.devices == 0:
            raise PlanError(f"{source}: {where}logical_mesh {list(stage.logical_mesh)} does not tile its submesh "
                            f"{list(stage.submesh)}")
        if stage.submesh[0] > mesh[0] or stage.submesh[1] > mesh[1]:
            raise PlanError(f"{source}: {where}submesh {list(stage.submesh)} does not fit in the mesh {list(mesh)}")
        stages.append(stage)
    if not stages:
        raise PlanError(f"{source}: a plan needs at least one stage")
    expected = 0
    for i, s in enumerate(stages):
        if s.layers[0] != expected or s.layers[1] <= s.layers[0]:
            raise PlanError(f"{source}: stages must cover the layers in order without gaps; stages[{i}] has "
                            f"{list(s.layers)}, expected to start at {expected}")
        expected = s.layers[1]
    if expected != len(layers):
        raise PlanError(f"{source}: the stages cover {expected} of {len(layers)} layers")
    units = data.get("units")
    if units is not None and not (isinstance(units, list) and units[:1] == [0] and all(
            isinstance(u, int) and not isinstance(u, bool) for u in units) and units == sorted(set(units))
            and units[-1] < len(layers)):
        raise PlanError(f"{source}: units must be the layers a unit begins at, in order from 0 (below "
                        f"{len(layers)}), or null (every layer a unit), got {units!r}")
    for i, s in enumerate(stages):
        count = len(_unit_starts(units, s.layers))
        if s.recompute_layers is not None and not (s.recompute and 1 <= s.recompute_layers < count):
            raise PlanError(f"{source}: stages[{i}].recompute_layers must be, with recompute true, a number of the "
                            f"stage's first units from 1 to {count - 1} (null: all of them), got {s.recompute_layers!r}")
    schedule = need(data, "schedule", str)
    if schedule not in schedules.SCHEDULES:
        raise PlanError(f"{source}: schedule must be one of {', '.join(schedules.SCHEDULES)}, got {schedule!r}")
    virtual = need(data, "virtual", int) if data["schema"] != "autopar.plan/1" else 1
    if virtual < 1 or len(stages) % virtual:
        raise PlanError(f"{source}: virtual must be a number of stages per device group that divides the "
                        f"{len(stages)} stages, got {virtual}")
    groups = len(stages) // virtual
    wrong = schedules.problem(schedule, groups, groups, virtual)  # one round of microbatches: any count runs
    if wrong:
        raise PlanError(f"{source}: {wrong}")
    where = schedules.stage_ranks(schedule, groups, virtual)
    for i, s in enumerate(stages):
        if s.submesh != stages[where[i]].submesh:
            raise PlanError(f"{source}: stages[{i}] runs on device group {where[i]} ({schedule}, {virtual} stages per "
                            f"group), whose submesh is {list(stages[where[i]].submesh)}, not {list(s.submesh)}")
    used = sum(s.devices for s in stages[:groups])
    if used != mesh[0] * mesh[1]:
        raise PlanError(f"{source}: the stages use {used} devices, the mesh {mesh[0]}x{mesh[1]} has {mesh[0] * mesh[1]}")
    gradient = need(data, "dp_gradient", dict)
    if gradient.get("zero_stage", 0) not in (0, 1, 2, 3):
        raise PlanError(f"{source}: dp_gradient.zero_stage must be 0, 1, 2 or 3, got {gradient.get('zero_stage')!r}")
    if gradient.get("compression") is not None:
        try:
            parse(str(gradient["compression"]))
        except AutoparError as exc:
            raise PlanError(f"{source}: dp_gradient.compression: {exc}") from None
    listed = gradient.setdefault("compressed", None)
    if listed is not None:
        names = {f for s in stages for f in s.params}
        if not (isinstance(listed, list) and all(isinstance(f, str) for f in listed)) or not set(listed) <= names:
            raise PlanError(f"{source}: dp_gradient.compressed must list parameters of the plan's stages (or be null: "
                            f"every weight matrix), got {str(listed)[:80]}")
        if gradient.get("compression") is None and listed:
            raise PlanError(f"{source}: dp_gradient.compressed lists parameters but no compression is set")
    delay = gradient.get("delay", 0)
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise PlanError(f"{source}: dp_gradient.delay must be a number of steps ≥ 0, got {delay!r}")
    precision = data.get("precision")
    if precision not in (None, "bf16", "fp16"):
        raise PlanError(f"{source}: precision must be \"bf16\", \"fp16\" or null (the model's dtype), got {precision!r}")
    why = stages_refusal(stages, schedule, virtual, gradient, precision)  # which features combine: the rule book's
    if why:
        raise PlanError(f"{source}: {why}")
    mb = need(data, "num_microbatches", int)
    batch = need(data, "batch", int)
    if not 1 <= batch <= MAX_BATCH or mb > MAX_MICROBATCHES:
        raise PlanError(f"{source}: batch {batch} and num_microbatches {mb} must be at most {MAX_BATCH} and "
                        f"{MAX_MICROBATCHES}")
    if mb < 1 or batch % mb:
        raise PlanError(f"{source}: num_microbatches {mb} must be at least 1 and divide the batch {batch}")
    wrong = schedules.problem(schedule, groups, mb, virtual)
    if wrong:
        raise PlanError(f"{source}: {wrong}")
    est = data.get("estimate")
    estimate = None
    if est is not None:
        fields = {f.name: f for f in dataclasses.fields(Estimate)}
        if not isinstance(est, dict) or set(est) != set(fields):
            raise PlanError(f"{source}: estimate must have exactly {', '.join(fields)}")
        for key in ("step_time_s", "tflops_per_device", "peak_memory_bytes", "bubble_fraction"):
            if not isinstance(est[key], (int, float)) or isinstance(est[key], bool) or not math.isfinite(est[key]):
                raise PlanError(f"{source}: estimate.{key} must be a finite number, got {est[key]!r}")
        estimate = Estimate(**{**est, "fits": bool(est["fits"])})
    return Plan(
        model=need(data, "model", str), graph_hash=need(data, "graph_hash", str), batch=batch,
        cluster=need(data, "cluster", str), mesh=mesh, layers=layers, stages=stages,
        num_microbatches=mb, schedule=schedule, virtual=virtual, precision=precision, dp_gradient=gradient, estimate=estimate,
        search=data.get("search") or {}, name=str(data.get("name", "auto")), units=units)


def _unit_starts(units: list[int] | None, layers: tuple[int, int]) -> list[int]:
    """The layers of [first, end) that begin a unit of a stage there: its first, and each of `units`
    inside (None: every layer)."""
    first, end = layers
    return [first, *(k for k in (range(first + 1, end) if units is None else units) if first < k < end)]


def _within(placements: list[Placement], ndim: int, where: str) -> None:
    for placement in placements:
        if isinstance(placement, Shard) and placement.dim >= ndim:
            raise PlanError(f"{where} is {_spell(placements)}: {placement} splits dimension {placement.dim} of a "
                            f"tensor with {ndim} dimension(s)")


def _spell(placements: list[Placement]) -> list[str]:
    return [str(p) for p in placements]


def _kind(kind: type | tuple) -> str:
    names = {list: "a list", dict: "an object", str: "a string", int: "an integer", bool: "true or false"}
    return " or ".join(names.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))
