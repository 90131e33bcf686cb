"""The rule book (`autopar/contract/compat.py`): which plan features combine is decided in one place,
and each refusal reads the same whoever asks — a hand-written layout, a plan file, `parallelize`,
the search's candidates, the runtime given a plan built in memory."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

import autopar
from autopar.contract import compat
from autopar.contract.compat import Features, refusal
from autopar.contract.plan import Plan, PlanError

PACKAGE = Path(autopar.__file__).resolve().parent

# the places that used to decide, each its own way, which features combine
PLACES = {"planner/manual.py": ["check"], "planner/search.py": ["runs"], "contract/plan.py": ["_parse"],
          "api.py": ["parallelize", "check", "_checked", "_resolve"], "runtime/pipeline.py": ["__init__"],
          "runtime/parallel.py": ["data_sync"]}
FEATURES = {"ZeRO": r"\bzero\b|ZeRO|FSDP", "compression": r"compress", "delay": r"delay",
            "recomputation": r"recomput", "split backward": r"splits? backward|zero-bubble|\bzbv\b",
            "fp16": r"fp16", "offload": r"offload", "sequence parallelism": r"sequence[- ]parallel",
            "virtual stages": r"virtual|interleav"}
# refusals naming two features that are not about a plan's features
NOT_PLAN_FEATURES = {"tune=K measures the free search's best layouts": "tune searches: a plan, compression or "
                                                                        "delay each fix what it would search"}


def _texts(path: Path, functions: list[str]) -> list[tuple[str, int, str]]:
    """(function, line, text) of every string a `raise` or a `return` in those functions spells."""
    tree = ast.parse(path.read_text())
    defined = [fn for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
               and fn.name in functions]
    assert {fn.name for fn in defined} == set(functions), f"{path}: {functions} (renamed? update PLACES)"
    out = []
    for fn in defined:
        for node in ast.walk(fn):
            if isinstance(node, ast.Raise) and node.exc is not None or isinstance(node, ast.Return) and node.value:
                parts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                if parts:
                    out.append((fn.name, node.lineno, "".join(parts)))
    return out


def test_no_compatibility_refusal_is_decided_outside_the_rule_book():
    """A refusal spelled in one of the six places names at most one plan feature: a combination
    of them is refused by the rule book's message, not one written there."""
    found = []
    for rel, functions in PLACES.items():
        for fn, line, text in _texts(PACKAGE / rel, functions):
            named = sorted(name for name, pattern in FEATURES.items() if re.search(pattern, text))
            if len(named) > 1 and not any(text.startswith(ok) for ok in NOT_PLAN_FEATURES):
                found.append(f"{rel}:{line} ({fn}) names {', '.join(named)}: {text[:90]!r}")
    assert not found, "\n".join(found)


def test_the_book_is_complete_and_each_message_has_its_values():
    """Every rule fires on some features and its message formats (no field left unfilled)."""
    cases = {rule.name: f for rule in compat.RULES for f in _examples() if rule.refuses(f)}
    assert set(cases) == {rule.name for rule in compat.RULES}
    for rule in compat.RULES:
        message = rule.message.format(**dataclasses.asdict(cases[rule.name]))
        assert "{" not in message and "}" not in message
    assert refusal(Features()) is None and refusal(Features(dp=4, tp=2, zero=1, schedule="interleaved-1f1b")) is None


def _examples() -> list[Features]:
    return [Features(schedule="interleaved-zb", recompute=True), Features(schedule="zbv", dp=2, zero=3),
            Features(schedule="interleaved-zb", stages=2, sizes_differ=True),
            Features(virtual=2, stages=4, meshes_differ=True), Features(virtual=2, stages=2),
            Features(zero=2, stages=2, dp=2), Features(zero=1, dp=1), Features(offload=True, dp=2),
            Features(zero=1, dp=2, compression="topk:0.01"), Features(compression="powersgd:2", delay=2),
            Features(precision="fp16", delay=1), Features(sequence_parallel=True)]


def _message(name: str, **values) -> str:
    rule = next(r for r in compat.RULES if r.name == name)
    return rule.message.format(**dataclasses.asdict(Features(**values)))


@pytest.fixture(scope="module")
def search():
    from autopar.cost_models import get_cluster
    from autopar.planner.search import Search

    w = autopar.load_workload("gpt-tiny", batch=8, device="cpu")
    return Search.start(w, get_cluster("cpu-local").with_ranks(4), (1, 4))


# (rule, the hand-written layout that breaks it, the schedule, the compression, the values its message takes)
LAYOUTS = [
    ("split backward with recomputation", "2,1,2,4", "interleaved-zb", None, {"schedule": "interleaved-zb"}),
    ("split backward with ZeRO", "2,1,2,4+z1", "interleaved-zb", None, {"schedule": "interleaved-zb"}),
    ("ZeRO-2 in a pipeline", "2,1,2+z2", "1f1b", None, {}),
    ("ZeRO without a data axis", "1,4,1+z1", "1f1b", None, {}),
    ("offload without ZeRO-1/2", "4,1,1+z3+offload", "1f1b", None, {}),
    ("ZeRO with compression or delayed averaging", "4,1,1+z1", "1f1b", "topk:0.01", {}),
    ("sequence parallelism without a tensor axis", "4,1,1+sp", "1f1b", None, {}),
    ("virtual stages without a pipeline", "4,1,1", "interleaved-1f1b", None, {}),
]


@pytest.mark.parametrize("rule, layout, schedule, compression, values", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_a_hand_written_layout_is_refused_with_the_books_message(search, rule, layout, schedule, compression, values):
    from autopar.planner.manual import Layout, check, manual_search

    view = dataclasses.replace(manual_search(search.compressed(compression) if compression else search),
                               schedule=schedule)
    parsed = Layout.parse(layout, rule == "split backward with recomputation", 2 if "virtual" in rule else 1)
    assert check(view, parsed) == _message(rule, **values)


def _plan_file(search, layout: str) -> dict:
    from autopar.planner.manual import Layout, manual_plan, manual_search

    return manual_plan(manual_search(search), Layout.parse(layout)).to_dict()


# (rule, a valid plan's layout, the edit that breaks it, the values its message takes)
FILES = [
    ("split backward with recomputation", "2,1,2,4", lambda p: (p.update(schedule="interleaved-zb"),
                                                                p["stages"][0].update(recompute=True)),
     {"schedule": "interleaved-zb"}),
    ("split backward with ZeRO", "2,1,2,4", lambda p: (p.update(schedule="interleaved-zb"),
                                                       p["stages"][1].update(zero=1)), {"schedule": "interleaved-zb"}),
    ("ZeRO-2 in a pipeline", "2,1,2", lambda p: p["stages"][0].update(zero=2), {}),
    ("ZeRO without a data axis", "1,4,1", lambda p: p["stages"][0].update(zero=1), {}),
    ("offload without ZeRO-1/2", "4,1,1", lambda p: p["stages"][0].update(offload=True), {}),
    ("ZeRO with compression or delayed averaging", "4,1,1",
     lambda p: (p["stages"][0].update(zero=1), p["dp_gradient"].update(delay=2)), {}),
    ("compression with delayed averaging", "4,1,1", lambda p: p["dp_gradient"].update(delay=2, compression="topk:0.01"),
     {}),
    ("fp16 with compression or delayed averaging", "4,1,1", lambda p: (p.update(precision="fp16"),
                                                                       p["dp_gradient"].update(delay=2)), {}),
    ("virtual stages without a pipeline", "2,1,2", lambda p: p.update(virtual=2, schedule="interleaved-1f1b",
                                                                      mesh=[1, 2]), {}),
]


@pytest.mark.parametrize("rule, layout, edit, values", FILES, ids=[c[0] for c in FILES])
def test_a_plan_file_and_the_runtime_refuse_with_the_books_message(search, rule, layout, edit, values):
    """Read from a file (`Plan.from_json`), and handed to the runtime built in memory (which asks
    the book again: `runtime.parallel.data_sync`, `PipelineModel`), the same words; the search
    would not offer it (`search.runs`)."""
    from autopar.planner.search import runs
    from autopar.runtime.parallel import UnsupportedPlan, data_sync

    data = _plan_file(search, layout)
    edit(data)
    with pytest.raises(PlanError) as error:
        Plan.from_json(json.dumps(data), "plan.json")
    assert str(error.value) == f"plan.json: {_message(rule, **values)}"
    plan = Plan.from_json(json.dumps(_plan_file(search, layout)))
    changed = dataclasses.replace(plan, **{k: v for k, v in data.items() if k in ("schedule", "virtual", "precision")
                                           and v != getattr(plan, k)},
                                  dp_gradient=data["dp_gradient"],
                                  stages=[dataclasses.replace(s, **{k: d[k] for k in ("zero", "offload", "recompute")
                                                                    if k in d})
                                          for s, d in zip(plan.stages, data["stages"])])
    assert not runs(changed)
    with pytest.raises(UnsupportedPlan, match=re.escape(_message(rule, **values))):
        data_sync([], None, changed)


def test_parallelize_refuses_the_callers_delay_over_a_zero_plan_with_the_books_message(tmp_path):
    """`parallelize(plan=..., delay=...)`: the caller's choice over the plan's, read as a plan file
    is (one process, before any model is built)."""
    import torch.distributed as dist

    w = autopar.load_workload("mlp-tiny", batch=8, device="cpu")
    from autopar.cost_models import get_cluster
    from autopar.planner.search import Search

    search = Search.start(w, get_cluster("cpu-local"), (1, 1))
    data = _plan_file(search, "1,1,1")
    data["precision"] = "fp16"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    try:
        with pytest.raises(autopar.AutoparError, match=re.escape(_message("fp16 with compression or delayed averaging"))):
            autopar.parallelize(w.model, (1, 1), w.example_inputs, plan=str(path), delay=2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
