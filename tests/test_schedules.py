"""A schedule is one registry entry: registering one makes the simulator, the memory model, the
planner, plan files, the CLI and the runtime's choice of torch class know it."""

import json

import pytest
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from autopar.cli import main
from autopar.contract import schedules
from autopar.contract.plan import Plan
from autopar.cost_models import get_cluster
from autopar.cost_models.simulator import StageTimes, simulate
from autopar.models import load_workload
from autopar.planner.search import Search, plan_auto
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
