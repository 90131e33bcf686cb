"""Ops without a sharding rule are said once per model (at info level: they run replicated, which
data parallelism does anyway), and warned about only where a plan's tensor axis must gather split
values whole for them."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

import autopar
from autopar.contract.workload import Workload
from autopar.cost_models import get_cluster
from autopar.planner.manual import Layout, manual_plan, manual_search
from autopar.planner.search import Search
from autopar.planner.unruled import warn_replicated


class _Odd(nn.Module):
    """An MLP whose hidden values go through `torch.diff` and `new_ones`, which have no rule."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h + torch.diff(h, dim=1, prepend=h.new_ones(h.shape[0], 1, h.shape[2]))
        return self.down(torch.relu(h))


def _plan(model, x, graph, layout):
    cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=2)
    search = Search.start(Workload("odd", model, (x,), x.shape[0]), cluster, (1, 2), graph=graph)
    return manual_plan(manual_search(search), Layout.parse(layout))


def test_ops_without_a_rule_are_summarised_once_and_warned_about_only_where_a_tensor_axis_gathers(caplog):
    model, x = _Odd(), torch.randn(8, 16, 32)
    with caplog.at_level(logging.INFO, logger="autopar"):
        graph = autopar.capture(model, (x,))
        data_parallel = _plan(model, x, graph, "2,1,1")
        warn_replicated(graph, data_parallel)
    notes = [r for r in caplog.records if r.name.startswith("autopar")]
    assert [r.levelno for r in notes] == [logging.INFO]  # one line for the model, nothing per op
    assert notes[0].getMessage() == ("_Odd: 2 ops of 2 kinds have no sharding rule and run replicated (on whole "
                                     "tensors wherever a tensor axis splits their inputs): aten.new_ones.default ×1, "
                                     "aten.diff.default ×1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="autopar"):
        warn_replicated(graph, _plan(model, x, graph, "1,2,1"))  # up's output split by columns, then diff
    [warning] = [r for r in caplog.records if r.name.startswith("autopar")]
    assert warning.levelno == logging.WARNING
    assert warning.getMessage().startswith(
        "the plan gathers split values whole on the tensor axis for 2 ops without a sharding rule "
        "(aten.new_ones.default ×1, aten.diff.default ×1; the first at ")
    assert "test_unruled.py" in warning.getMessage() and "in forward" in warning.getMessage()
