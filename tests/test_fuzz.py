"""Hostile and broken plan files, cluster files and command-line numbers: every one ends in an
AutoparError (one message, exit 2), never another exception, never a hang."""

from __future__ import annotations

import copy
import json
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.contract.errors import AutoparError
from autopar.contract.plan import Plan
from autopar.cost_models import get_cluster
from autopar.cost_models.cluster import ClusterSpec
from autopar.planner.capture import capture

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

# what a mutation puts somewhere: wrong types, huge and non-finite numbers, wrong placements
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.sampled_from([10**40, -(10**40), 2**70]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.sampled_from(["R", "P", "S(0)", "S(1)", "S(99)", "S(-1)", "[bold]x[/]", "\x1b[2J", "/dev/zero"]),
    st.lists(st.sampled_from(["R", "P", "S(0)", "S(3)", None, 1]), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def mlp():
    w = autopar.load_workload("mlp-tiny", batch=8, device="cpu")
    graph = capture(w.model, w.example_inputs)
    shapes = {n: tuple(p.shape) for n, p in w.model.named_parameters(remove_duplicate=False)}
    return graph, shapes


def _paths(value, prefix=()):
    """Every path into a JSON value (keys and indices)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _mutate(data, path, value, how):
    data = copy.deepcopy(data)
    if not path:
        return value
    *head, last = path
    parent = data
    for key in head:
        parent = parent[key]
    if how == "delete" and isinstance(parent, dict):
        del parent[last]
    elif how == "rename" and isinstance(parent, dict):
        parent[f"{last}x"] = parent.pop(last)
    else:
        parent[last] = value
    return data


@pytest.fixture(scope="module")
def valid():
    """A plan as the planner writes it (mlp-tiny, two ranks: a tensor axis, so needs are in it)."""
    from autopar.planner.auto import plan_auto
    from autopar.planner.search import Search

    w = autopar.load_workload("mlp-tiny", batch=8)
    return json.loads(plan_auto(Search.start(w, get_cluster("cpu-local"), (1, 2))).to_json())


@SETTINGS
@given(data=st.data())
def test_mutated_plans_are_refused_with_one_message_or_pass_every_check(mlp, valid, data):
    graph, shapes = mlp
    path = data.draw(st.sampled_from(list(_paths(valid))))
    mutant = _mutate(valid, path, data.draw(VALUES), data.draw(st.sampled_from(["set", "delete", "rename"])))
    try:
        plan = Plan.from_json(json.dumps(mutant), "mutant")
        plan.summary()
        plan.check_graph(plan.graph_hash)
        plan.check_placements(graph, shapes)
    except AutoparError:
        pass


@SETTINGS
@given(text=st.one_of(st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
                      st.integers(1, 3000).map(lambda d: "[" * d + "]" * d),
                      st.integers(1, 5000).map(lambda d: '{"mesh": [' + "9" * d + ", 1]}")))
def test_garbage_plan_text_is_one_message(text):
    with pytest.raises(AutoparError):
        Plan.from_json(text, "garbage")


@SETTINGS
@given(data=st.data())
def test_mutated_cluster_files_are_refused_with_one_message(tmp_path_factory, data):
    valid = get_cluster("a100-dgx").to_dict()
    path = data.draw(st.sampled_from(list(_paths(valid))))
    mutant = _mutate(valid, path, data.draw(VALUES), data.draw(st.sampled_from(["set", "delete", "rename"])))
    file = tmp_path_factory.mktemp("c") / "cluster.json"
    file.write_text(json.dumps(mutant))
    try:
        spec = ClusterSpec.load(file)
    except AutoparError:
        return
    assert spec.num_hosts * spec.devices_per_host <= 16384


def test_a_cluster_that_is_no_regular_file_is_refused_at_once(tmp_path):
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    for path in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(AutoparError, match="not a regular file|does not exist|cannot read"):
            get_cluster(str(path))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(flag=st.sampled_from(["--batch", "--mesh", "--time-limit", "--memory-limit", "--stages", "--compression"]),
       value=st.one_of(st.integers(-10**30, 10**30).map(str), st.sampled_from(
           ["nan", "inf", "-inf", "1e400", "2**70", "0", "1x0", "100000x8", "1x²", "x", "powersgd:nan",
            "topk:inf", "dgc:0.5,warmup=nan", "qsgd:1e300", "", "[/]"]),
           st.text(max_size=6)))
def test_command_line_numbers_end_in_one_message(flag, value, capsys):
    from autopar.cli import main

    argv = ["plan", "mlp-tiny", "--mesh", "1x2", "--time-limit", "5", flag, value]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: its one line, exit 2
        code = exc.code
    assert code in (0, 2)
    assert "Traceback" not in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
