"""Values cross pipeline-stage boundaries whatever their memory layout: each block of this CNN hands
the next one a permuted view, a channels-last tensor, a transposed view or an expanded one (gloo and
NCCL send only contiguous tensors; so do their gradients come back: a split backward's input
gradient is autograd's own, permuted where the input was), and a 2-stage pipeline trains as one
process does, under 1F1B and a zero-bubble schedule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from tests.distributed import on_rank0, shared_ranks
from tests.test_parallelize import _optimizer, train_one_process

BATCH, CHANNELS, SIZE, STEPS = 8, 8, 8, 2
# a 2-stage pipeline starts its second stage with the third block: its input reaches it only through
# a permute, so the input's gradient goes back permuted
KINDS = ["channels-last", "transposed", "permuted", "expanded"]
LAYOUTS = {"pp": ("1f1b", "1,1,2,2"), "pp-zero-bubble": ("interleaved-zb", "1,1,2,2"), "searched": None}


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.norm = nn.LayerNorm(CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "permuted":  # ConvNeXt's way: a norm over channels, channels last, then back
            return torch.relu(self.conv(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)))
        h = torch.relu(self.conv(x))
        if self.kind == "channels-last":
            return (x + h).contiguous(memory_format=torch.channels_last)
        if self.kind == "transposed":
            return (x + h).transpose(2, 3)
        return x + h.mean(dim=1, keepdim=True).expand_as(h)  # one map for every channel: stride 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(kind) for kind in KINDS)
        self.head = nn.Linear(CHANNELS, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _setup():
    torch.manual_seed(0)
    model = Net()
    gen = torch.Generator().manual_seed(5)
    batches = [((torch.randn(BATCH, CHANNELS, SIZE, SIZE, generator=gen),), torch.randint(0, 4, (BATCH,), generator=gen))
               for _ in range(STEPS)]
    return autopar.Workload("boundaries", model, batches[0][0], BATCH, nn.functional.cross_entropy), batches


def _plan(w, layout):
    """The layout under its schedule, made on rank 0 and sent to the other (as `parallelize` does)."""
    import dataclasses

    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search

    if LAYOUTS[layout] is None:
        return None
    schedule, text = LAYOUTS[layout]
    cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=2)
    return on_rank0(lambda: manual_plan(manual_search(Search.start(w, cluster, (1, 2), schedule=schedule)),
                                        Layout.parse(text)))


def _parallel(rank, world, layout):
    w, batches = _setup()
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=_optimizer,
                             plan=_plan(w, layout))
    return [pm.step(*b) for b in batches], pm.full_state_dict(), len(pm.plan.stages)


CASES = [(k,) for k in LAYOUTS]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_of_any_memory_layout_cross_stage_boundaries(tmp_path, layout):
    losses, params = train_one_process(*_setup())
    for got_losses, got_params, stages in shared_ranks(_parallel, 2, CASES, (layout,), tmp_path):
        assert LAYOUTS[layout] is None or stages == 2
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for key, value in params.items():
            torch.testing.assert_close(got_params[key], value, rtol=1e-5, atol=1e-6)
