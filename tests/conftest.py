import os
import tempfile

import pytest
import torch

from autopar import capture, load_workload

# the tests plan on the nominal cpu-local, whatever `autopar calibrate` measured on this machine
# (spawned ranks inherit the variable)
os.environ.setdefault("AUTOPAR_CLUSTER", os.path.join(tempfile.mkdtemp(prefix="autopar-tests-"), "uncalibrated.json"))
# each test plans afresh (and never reads or fills the user's plan cache); tests/test_plan_cache.py
# turns it on where it checks it
os.environ["AUTOPAR_PLAN_CACHE"] = "off"


@pytest.fixture(scope="session")
def gpt_tiny_graph():
    w = load_workload("gpt-tiny")
    return w, capture(w.model, w.example_inputs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the tests' ids
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command), every test of a module
    that starts gloo ranks (`tests.distributed`) runs on one worker, in order, as one group: its
    case lists share the worker's kept ranks, and two workers' rank pools never run at once (8 ranks
    on 2 cores ran the suite slower than one process, 2026-11-29). The other worker takes the rest:
    the planner's tests and the CLI's launches, whose start-up and timeouts leave cores idle."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and (hasattr(module, "shared_ranks") or hasattr(module, "run_ranks")):
            item.add_marker(pytest.mark.xdist_group("ranks"))
