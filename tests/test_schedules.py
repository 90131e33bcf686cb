"""A schedule is one registry entry: registering one makes the simulator, the memory model, the
planner, plan files, the CLI and the runtime's choice of torch class know it."""

import json

import pytest
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
        "toy", order=lambda n, s, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)],
        in_flight=lambda n, s, m: m, torch_class="ScheduleGPipe"))
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

