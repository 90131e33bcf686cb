"""Which plan features combine, and why not where they do not: the one place such a refusal is
decided and worded.

A plan combines a schedule, a pipeline of stages (virtual ones too), each stage's data and tensor
axes, ZeRO, host offload, recomputation and sequence parallelism with the data axis's gradient
choices (a compressor, delayed averaging) and a precision. Some combinations the runtime cannot
run as one process would, or at all. The planner (hand-written layouts, the search's candidates),
plan validation (a plan file), `parallelize` (the caller's compression or delay over a plan) and
the runtime (a plan built in memory) ask `refusal`; each refusal has one message whoever asks,
which the caller may put after its own context ("layout 2,1,2+z2 is not valid ...: ",
"plan.json: ").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autopar.contract.schedules import splits_backward


@dataclass(frozen=True)
class Features:
    """What one stage of a plan combines (plan-wide choices repeated on each)."""

    schedule: str = "1f1b"
    stages: int = 1  # the plan's stages, virtual ones included
    virtual: int = 1  # stages per device group
    dp: int = 1  # this stage's data axis
    tp: int = 1  # this stage's tensor axis
    zero: int = 0  # ZeRO-1 / ZeRO-2 of the data-replicated parameters; 3: parameters sharded over the data axis
    offload: bool = False  # ZeRO's shards in host memory
    recompute: bool | str = False
    sequence_parallel: bool = False
    compression: str | None = None  # the data axis's gradient compressor
    delay: int = 0  # delayed averaging, in steps
    precision: str | None = None  # "bf16", "fp16", None (the model's dtype)
    sizes_differ: bool = False  # the plan's stages run on device groups of different sizes
    meshes_differ: bool = False  # the plan's stages have different logical meshes


@dataclass(frozen=True)
class Rule:
    name: str
    refuses: Callable[[Features], bool]
    message: str  # formatted with the features' fields


_ALTERNATIVES = "use interleaved-1f1b or 1f1b"

RULES: tuple[Rule, ...] = (
    Rule("split backward with recomputation", lambda f: splits_backward(f.schedule) and bool(f.recompute),
         "{schedule} splits backward, and torch's checkpoint cannot recompute a layer for its input gradient and "
         f"again for its weight gradient: {_ALTERNATIVES}, or no recomputation"),
    Rule("split backward with ZeRO", lambda f: splits_backward(f.schedule) and f.zero > 0,
         "{schedule} splits backward, which FSDP2's ZeRO does not yet train as one process does (losses differ by "
         f"1e-5 to 1e-4): {_ALTERNATIVES}, or no ZeRO"),
    Rule("split backward over stages of different sizes", lambda f: splits_backward(f.schedule) and f.sizes_differ,
         "{schedule} splits backward, which stages of different sizes do not run: use 1f1b, or stages of one size"),
    Rule("virtual stages of different sizes", lambda f: f.virtual > 1 and (f.sizes_differ or f.meshes_differ),
         "{virtual} stages per device group run stages of one size and logical mesh: plan the stages alike, or "
         "one stage per device group"),
    Rule("virtual stages without a pipeline", lambda f: f.virtual > 1 and f.stages <= f.virtual,
         "one device group would hold every stage: nothing to interleave (virtual stages need 2 or more device "
         "groups)"),
    Rule("ZeRO-2 in a pipeline", lambda f: f.zero == 2 and f.stages > 1,
         "ZeRO-2 runs in one-stage plans: torch's pipeline schedules keep a stage's gradients whole until its last "
         "backward; use ZeRO-1 in a pipeline"),
    Rule("ZeRO without a data axis", lambda f: f.zero > 0 and f.dp == 1,
         "ZeRO shards over the data axis: it needs a data axis of 2 or more"),
    Rule("offload without ZeRO-1/2", lambda f: f.offload and f.zero not in (1, 2),
         "offload moves the states ZeRO-1/2 shard to host memory: it needs ZeRO-1 or ZeRO-2 on the stage (add +z1 "
         "or +z2 to a layout, --zero, or a stage's zero in a plan file)"),
    Rule("ZeRO with compression or delayed averaging", lambda f: f.zero > 0 and bool(f.compression or f.delay),
         "compression and delayed averaging work on the data axis's whole gradients, which ZeRO shards: drop the "
         "one or the other"),
    Rule("compression with delayed averaging", lambda f: bool(f.compression) and f.delay > 0,
         "delayed averaging runs on dense gradients: use compression or delay, not both"),
    Rule("fp16 with compression or delayed averaging",
         lambda f: f.precision == "fp16" and bool(f.compression or f.delay),
         "fp16 scales the loss, and compressors and delayed averaging keep gradients across steps (error "
         "feedback, averages in flight), where a scaled or overflowed one would stay: use bf16 mixed precision"),
    Rule("sequence parallelism without a tensor axis", lambda f: f.sequence_parallel and f.tp == 1,
         "sequence parallelism splits the sequence over the tensor axis: it needs a tensor axis of 2 or more"),
)


def refusals(features: Features) -> Iterator[tuple[Rule, str]]:
    """Every rule `features` break, with its message."""
    for rule in RULES:
        if rule.refuses(features):
            yield rule, rule.message.format(**features.__dict__)


def refusal(features: Features) -> str | None:
    """Why these features do not combine (the first rule broken), or None."""
    return next((message for _, message in refusals(features)), None)


def plan_refusal(plan: Any) -> str | None:
    """Why a plan's stages do not combine, or None. `plan`: a `contract.plan.Plan` (this module
    sits below it: any object with its fields)."""
    return stages_refusal(plan.stages, plan.schedule, plan.virtual, plan.dp_gradient, plan.precision)


def stages_refusal(stages: list[Any], schedule: str, virtual: int, dp_gradient: dict | None,
                   precision: str | None) -> str | None:
    """Why these stages (`contract.plan.StagePlan`s) do not combine with the plan-wide choices, or None."""
    gradient = dp_gradient or {}
    sizes = {s.submesh[0] * s.submesh[1] for s in stages}
    meshes = {tuple(s.logical_mesh) for s in stages}
    for s in stages:
        dp = s.logical_mesh[0]
        zero3 = dp > 1 and any(str(p[0]) == "S(0)" for p in s.params.values())  # (typed, or as a file spells it)
        why = refusal(Features(
            schedule=schedule, stages=len(stages), virtual=virtual, dp=dp, tp=s.logical_mesh[1],
            zero=3 if zero3 else (s.zero or 0), offload=bool(s.offload),
            recompute=(s.recompute_granularity or True) if s.recompute else False,
            compression=gradient.get("compression"), delay=gradient.get("delay", 0) or 0, precision=precision,
            sizes_differ=len(sizes) > 1, meshes_differ=len(meshes) > 1))
        if why:
            return why
    return None
