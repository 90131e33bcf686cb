import pytest
import torch

from autopar import capture, load_workload


@pytest.fixture(scope="session")
def gpt_tiny_graph():
    w = load_workload("gpt-tiny")
    return w, capture(w.model, w.example_inputs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
