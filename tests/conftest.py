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
