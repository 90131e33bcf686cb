"""A schedule is one registry entry: registering one makes the simulator, the memory model, the
planner, plan files, the CLI and the runtime's choice of torch class know it."""

import json

import pytest
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from autopar.cli import main
from autopar.contract import schedules
from autopar.contract.plan import Plan, PlanError
from autopar.cost_models import get_cluster
from autopar.cost_models.simulator import StageTimes, simulate
from autopar.models import load_workload
from autopar.planner.auto import plan_auto
from autopar.planner.search import Search
from autopar.runtime.pipeline import schedule_class


@pytest.fixture
def toy(monkeypatch):
    """GPipe's order under another name, registered for this test only."""
    monkeypatch.setattr(schedules, "SCHEDULES", dict(schedules.SCHEDULES))
    schedules.register(schedules.Schedule(
        "toy", order=lambda p, r, m, v: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)],
        torch_class="ScheduleGPipe"))
    return "toy"


def test_registered_schedule_is_simulated_and_priced(toy):
    stages = [StageTimes(1.0, 2.0, 0.1, 0.0), StageTimes(1.5, 3.0, 0.0, 0.0)]
    assert simulate(stages, 4, toy).step_time_s == simulate(stages, 4, "gpipe").step_time_s
    assert schedules.in_flight(toy, 4, 3, 16) == 16


def test_registered_schedule_plans_and_round_trips(toy, tmp_path):
    search = Search.start(load_workload("gpt-tiny", batch=8), get_cluster("a100-dgx").with_mesh(1, 2), (1, 2),
                          schedule=toy)
    plan = plan_auto(search, stages=2, num_microbatches=4)
    assert plan.schedule == toy
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").schedule == toy


def test_registered_schedule_on_the_command_line(toy, capsys):
    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x2", "--batch", "8", "--stages", "2",
                 "--schedule", toy, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == toy


def test_runtime_runs_the_registered_class(toy):
    assert schedule_class(toy, 2, 4) is ScheduleGPipe
    assert schedule_class("1f1b", 2, 4) is Schedule1F1B
    assert schedule_class("1f1b", 4, 2) is ScheduleGPipe  # torch's 1F1B refuses fewer microbatches than stages



def _torch_order(name: str, p: int, m: int, v: int) -> dict[int, list[tuple[str, int, int]]]:
    """The actions torch's class issues on each rank (its own `_calculate_single_rank_operations`,
    on an instance given only what that reads: building one needs a process group per stage)."""
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    cls = getattr(torch_schedules, schedules.get(name).torch_class)
    obj = object.__new__(cls)
    rounds = max(1, m // p)
    obj.__dict__.update(pp_group_size=p, n_local_stages=v, _n_microbatches=m, num_stages=p * v, _num_stages=p * v,
                        number_of_rounds=rounds, microbatches_per_round=m // rounds)
    return {r: [(kind[a.computation_type.name], a.stage_index, a.microbatch_index)
                for a in obj._calculate_single_rank_operations(r) if a is not None] for r in range(p)}


@pytest.mark.parametrize("name, virtuals", [("interleaved-1f1b", (1, 2, 3, 4)), ("interleaved-zb", (1, 2, 3, 4)),
                                            ("zbv", (2,))])
def test_orders_are_the_ones_torch_issues(name, virtuals):
    """What the simulator replays is what the runtime runs, action by action, on every rank."""
    checked = 0
    for p in (1, 2, 3, 4, 8):
        for v in virtuals:
            for m in range(1, 20):
                if schedules.problem(name, p, m, v):
                    continue
                theirs = _torch_order(name, p, m, v)
                assert all(schedules.order(name, p, r, m, v) == theirs[r] for r in range(p)), (p, v, m)
                checked += 1
    assert checked > 40


def _uniform(n: int, weight: float = 0.0) -> list[StageTimes]:
    return [StageTimes(1.0, 2.0, 0.0, 0.0, weight_s=weight) for _ in range(n)]


def _bubble_ratio(sim) -> float:
    """Idle time over busy time (the papers' bubble: (p − 1)/m for 1F1B)."""
    return sim.bubble_fraction / (1 - sim.bubble_fraction)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_bubbles_on_uniform_stages_have_their_closed_forms(p, m):
    assert _bubble_ratio(simulate(_uniform(p), m, "1f1b")) == pytest.approx((p - 1) / m)
    for v in (2, 4):  # Narayanan et al. (2021): the bubble shrinks by the number of chunks
        sim = simulate(_uniform(p * v), m, "interleaved-1f1b", virtual=v)
        assert _bubble_ratio(sim) == pytest.approx((p - 1) / (v * m))
    # ZB-H1 (Qi et al., 2024) with F = I = W: a bubble of (p − 1)(F + I − W) against 1F1B's (p − 1)(F + I + W)
    zb = simulate(_uniform(p, weight=1.0), m, "interleaved-zb")
    idle = zb.bubble_fraction * p * max(e.end for e in zb.events if e.kind in "FIW")
    assert idle / p == pytest.approx((p - 1) * 1.0)
    assert _bubble_ratio(zb) == pytest.approx(_bubble_ratio(simulate(_uniform(p), m, "1f1b")) / 3)
    # ZB-V: two chunks in a V, near zero when F = I = W (the paper's figure 8)
    zbv = simulate(_uniform(2 * p, weight=1.0), m, "zbv", virtual=2)
    assert zbv.step_time_s < simulate(_uniform(2 * p, weight=1.0), m, "interleaved-1f1b", virtual=2).step_time_s


def test_split_backward_costs_what_the_whole_one_does_with_one_stage():
    one = simulate(_uniform(1, weight=1.0), 4, "interleaved-zb")
    assert one.step_time_s == pytest.approx(4 * 3.0)
    assert one.bubble_fraction == pytest.approx(0.0)


def test_interleaving_holds_more_activations_and_zero_bubble_holds_them_longer():
    """Megatron-LM's interleaved schedule keeps more microbatch-chunks in flight on the first rank
    (each a v-th of a stage's activations); ZB-H1 keeps at most 1F1B's peak, the first rank's, on
    every rank (a weight-gradient part holds its activations until it runs)."""
    p, m = 4, 8
    assert schedules.in_flight("1f1b", p, 0, m) == p
    assert schedules.in_flight("interleaved-1f1b", p, 0, m, 2) == p + 2 * (p - 1) + 1  # (v-1)·p + 2(p-1) + 1 chunks
    assert [schedules.in_flight("interleaved-zb", p, r, m) for r in range(p)] == [p] * p


def _two_stages() -> Plan:
    from autopar.planner.manual import Layout, manual_plan, manual_search

    search = Search.start(load_workload("gpt-tiny", batch=8), get_cluster("a100-dgx").with_mesh(1, 2), (1, 2))
    return manual_plan(manual_search(search), Layout(1, 1, 2, 4))


def test_schema_1_and_2_plans_load_with_one_stage_per_group_and_every_layer_a_unit(tmp_path):
    plan = _two_stages()
    data = plan.to_dict()
    assert data["schema"] == "autopar.plan/4" and data["virtual"] == 1 and data["units"] is None
    old = {k: v for k, v in data.items() if k not in ("virtual", "units")} | {"schema": "autopar.plan/1"}
    loaded = Plan.from_json(json.dumps(old))
    assert loaded.virtual == 1 and loaded.stage_ranks == [0, 1] and loaded.units is None
    two = Plan.from_json(json.dumps({k: v for k, v in data.items() if k != "units"} | {"schema": "autopar.plan/2"}))
    assert two.units is None and two.stage_units(two.stages[1]) == [layer["nodes"] for layer in
                                                                   two.layers[slice(*two.stages[1].layers)]]
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_units_group_layers_and_a_stage_cut_inside_one_begins_its_own():
    plan = _two_stages()
    first, second = plan.stages
    assert first.layers[1] - first.layers[0] >= 2
    plan.units = [0, first.layers[0] + 1]  # the second unit starts inside stage 0 and runs into stage 1
    again = Plan.from_json(plan.to_json())
    assert again.units == plan.units
    nodes = [layer["nodes"] for layer in plan.layers]
    assert again.stage_units(first) == [nodes[0], [n for k in range(1, first.layers[1]) for n in nodes[k]]]
    assert again.stage_units(second) == [[n for k in range(*second.layers) for n in nodes[k]]]
    assert len(again.stage_units(second)) == 1 < second.layers[1] - second.layers[0]


@pytest.mark.parametrize("units", [[1], [0, 0], [0, 99], [2, 0], "0", [0, True]])
def test_units_that_are_not_layer_starts_in_order_are_refused(units):
    data = _two_stages().to_dict() | {"units": units}
    with pytest.raises(PlanError, match="units must be the layers a unit begins at"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("edit, message", [
    ({"virtual": 3}, "virtual must be a number of stages per device group that divides the 2 stages"),
    ({"virtual": 2, "schedule": "zbv", "mesh": [1, 1]}, "one device group would hold every stage: nothing to interleave"),
])
def test_a_plan_whose_virtual_stages_do_not_add_up_is_refused(edit, message):
    data = _two_stages().to_dict() | edit
    with pytest.raises(Exception, match=message):
        Plan.from_json(json.dumps(data))


def test_a_stage_on_another_groups_submesh_is_refused():
    from autopar.planner.manual import Layout, manual_plan, manual_search

    search = Search.start(load_workload("gpt-small", batch=16), get_cluster("a100-dgx").with_mesh(1, 2), (1, 2),
                          schedule="zbv")
    data = manual_plan(manual_search(search), Layout(1, 1, 2, 4, virtual=2)).to_dict()
    assert Plan.from_json(json.dumps(data)).stage_ranks == [0, 1, 1, 0]
    data["stages"][3] |= {"submesh": [1, 2], "logical_mesh": [2, 1]}
    with pytest.raises(Exception, match=r"stages\[3\] runs on device group 0 \(zbv, 2 stages per group\), whose "
                                        r"submesh is \[1, 1\], not \[1, 2\]"):
        Plan.from_json(json.dumps(data))
    data["stages"][3] |= {"submesh": [1, 1], "logical_mesh": [1, 1]}
    with pytest.raises(Exception, match="schedule 1f1b runs 1 stage per device group, not 2"):
        Plan.from_json(json.dumps(data | {"schedule": "1f1b"}))
    with pytest.raises(Exception, match=r"interleaved schedules split the microbatches into max\(1, m // p\) = 2 "
                                        "equal rounds on 2 device groups: 5 microbatches do not split"):
        Plan.from_json(json.dumps(data | {"schedule": "interleaved-1f1b", "num_microbatches": 5, "batch": 15}))


def test_balanced_cuts_find_the_least_bottleneck_then_the_least_total():
    import itertools

    import numpy as np

    from autopar.planner.search import balanced_cuts

    rng = np.random.default_rng(0)
    for _ in range(30):
        n, q = int(rng.integers(2, 8)), int(rng.integers(1, 5))
        w = rng.uniform(0.5, 2.0, n)
        times = np.full((n + 1, n + 1), np.inf)
        for i in range(n):
            for j in range(i + 1, n + 1):
                times[i, j] = w[i:j].sum() if rng.random() > 0.1 else np.inf  # some ranges do not fit
        best = min(((max(times[a, b] for a, b in zip(c, c[1:])), sum(times[a, b] for a, b in zip(c, c[1:])))
                    for inner in itertools.combinations(range(1, n), q - 1) for c in [(0, *inner, n)]),
                   default=(np.inf, np.inf))
        cuts = balanced_cuts(times, q)
        if not np.isfinite(best[0]):
            assert cuts is None
            continue
        got = [times[a, b] for a, b in zip(cuts, cuts[1:])]
        assert len(got) == q and (max(got), sum(got)) == pytest.approx(best)


def test_auto_weighs_every_schedule_and_keeps_the_fastest_that_fits():
    from autopar.planner.search import replay

    search = Search.start(load_workload("gpt-1.3b", batch=1024), get_cluster("v100-p3"), (1, 4), schedule="auto")
    plan = plan_auto(search, stages=2)  # a pipeline (free, one stage of ZeRO-1 data parallelism is as fast)
    tried = plan.search["schedules"]
    assert {"1f1b", "interleaved-zb", "interleaved-1f1b/v2", "interleaved-zb/v2", "zbv/v2"} <= set(tried)
    fastest = min(t["step_time_s"] for t in tried.values() if t.get("fits"))
    # a candidate is left unsimulated only when its busiest group's work alone is slower
    assert all(t["busiest_group_s"] >= fastest for t in tried.values() if t.get("skipped"))
    assert plan.estimate.step_time_s == fastest and plan.estimate.fits
    assert tried[plan.schedule + (f"/v{plan.virtual}" if plan.virtual > 1 else "")]["step_time_s"] == fastest
    assert replay(plan).step_time_s == pytest.approx(plan.estimate.step_time_s)  # the plan alone says it
    assert len(plan.stages) == plan.groups * plan.virtual and len({s.logical_mesh for s in plan.stages}) == 1


def test_auto_keeps_1f1b_where_no_other_schedule_applies():
    """One stage (no pipeline): nothing else to weigh."""
    search = Search.start(load_workload("gpt-tiny", batch=8), get_cluster("a100-dgx").with_mesh(1, 2), (1, 2),
                          schedule="auto")
    plan = plan_auto(search, stages=1, num_microbatches=2)
    assert plan.schedule == "1f1b" and plan.search["schedules"] == {
        "1f1b": {"step_time_s": plan.estimate.step_time_s, "fits": plan.estimate.fits}}


def test_virtual_on_the_command_line(capsys):
    args = ["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x2", "--batch", "8", "--json"]
    assert main(args + ["--virtual", "2"]) == 2
    assert "--virtual 2: the stages per device group of a --manual layout" in capsys.readouterr().err
    assert main(args + ["--manual", "1,1,2,4", "--virtual", "2", "--schedule", "1f1b"]) == 2
    assert "2 blocks do not split evenly into 4 stages" in capsys.readouterr().err
    assert main(args + ["--manual", "1,1,2,4", "--schedule", "interleaved-zb"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "interleaved-zb"
    assert main(args + ["--manual", "1,1,2,4", "--schedule", "interleaved-zb", "--recompute"]) == 2
    assert "interleaved-zb splits backward, and torch's checkpoint cannot recompute" in capsys.readouterr().err
    assert main(args + ["--manual", "2,1,1", "--virtual", "2", "--schedule", "interleaved-1f1b"]) == 2
    assert "nothing to interleave (virtual stages need 2 or more device groups)" in capsys.readouterr().err


def test_the_search_offers_zero3_only_with_a_whole_backward():
    """The runtime refuses ZeRO-3 under a split backward (tests/test_pipeline_schedules.py): such a
    plan is never a candidate of `--schedule auto`."""
    import dataclasses

    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import runs

    search = Search.start(load_workload("gpt-tiny", batch=8), get_cluster("a100-dgx").with_mesh(1, 4), (1, 4))
    sharded = manual_search(search, zero3=True)
    for schedule, ok in (("1f1b", True), ("interleaved-1f1b", True), ("interleaved-zb", False)):
        plan = manual_plan(dataclasses.replace(sharded, schedule=schedule), Layout(2, 1, 2, 4))
        assert plan.dp_gradient["zero_stage"] == 3 and runs(plan) is ok
