"""Dropout under a tensor axis (GPT-2, every rate 0.1, 2 and 4 gloo ranks): a value the plan replicates over
the tensor axis draws one mask on every rank of the group, a split value its own per rank
(`runtime.rng`), inside the lowered program. Otherwise replicated activations, then the weights
they train, drift apart between the ranks of a group, silently."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from tests.distributed import shared_ranks
from tests.families import TEST_LAYERS, optimizer, setup, single
from tests.test_parallelize import _world

STEPS, RATE = 4, 0.1
LAYOUTS = {"tp": "1,2,1", "dp-tp": "2,2,1", "tp-pp": "1,2,2,2"}
# recomputation against the tensor axis alone (a data axis beside it changes no mask a group draws)
RECOMPUTED = {"tp-recompute": "1,2,1+recompute", "tp-selective": "1,2,1+selective"}
LAYOUTS |= RECOMPUTED


def _ranks(layout: str, tmp_path) -> list[dict]:
    """The layout's results from the start of the ranks its world shares (a 4-rank case costs about 3
    times a 2-rank one on 2 cores)."""
    world = _world(LAYOUTS[layout])
    return shared_ranks(_train, world, [(k,) for k in LAYOUTS if _world(LAYOUTS[k]) == world], (layout,), tmp_path)


def _replicated(pm) -> dict[str, torch.Tensor]:
    """This rank's copy of every parameter the tensor axis replicates."""
    root = getattr(pm, "trained", None) or pm.module
    return {n: p.to_local().detach().clone() for n, p in root.named_parameters()
            if isinstance(p, DTensor) and p.placements[-1].is_replicate()}


def _train(rank, world, layout):
    w, batches = setup("gpt2", steps=STEPS, dropout=RATE, layers=TEST_LAYERS)
    torch.manual_seed(100 + rank)  # every rank's own stream, as scripts seeding by rank have
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                             plan=LAYOUTS[layout])
    losses = [pm.step(inputs, target) for inputs, target in batches]
    group = (pm.stage_index, pm.dp_rank) if hasattr(pm, "stage_index") else (0, pm.rank)
    output = None
    if getattr(pm, "graph", None) is not None:  # a replicated activation: the logits, with dropout on
        with torch.no_grad():
            m = pm.plan.num_microbatches
            output = pm.graph(*(x.tensor_split(pm.dp)[pm.rank].tensor_split(m)[0] for x in batches[0][0])).clone()
    return {"losses": losses, "group": group, "replicated": _replicated(pm), "output": output,
            "runs": [(p["runs"], p["why"]) for p in pm.programs()]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_masks_agree_across_a_tensor_group_and_training_stays_close_to_one_process(tmp_path, layout):
    torch.manual_seed(0)
    reference, _ = single("gpt2", steps=STEPS, dropout=RATE, layers=TEST_LAYERS)
    ranks = _ranks(layout, tmp_path)
    groups: dict[tuple, list[dict]] = {}
    for r in ranks:
        groups.setdefault(r["group"], []).append(r)
    for r in ranks:  # split attention weights draw their masks inside the lowered program
        assert all(runs == "lowered" for runs, _ in r["runs"]), r["runs"]
    for members in groups.values():
        assert len(members) > 1 and members[0]["replicated"]
        first = members[0]
        for other in members[1:]:
            for name, value in first["replicated"].items():
                assert torch.equal(other["replicated"][name], value), f"{name} drifted apart within a tensor group"
            if first["output"] is not None:
                assert torch.equal(other["output"], first["output"])
    # other masks than one process draws: the same training, statistically (dropout 0.1 moves these
    # losses by ~1e-3; a rank that dropped nothing or everything would move them by more than 1e-2)
    assert ranks[0]["losses"] == pytest.approx(reference, rel=1e-2)


@pytest.mark.parametrize("layout", RECOMPUTED)
def test_recomputation_draws_the_same_masks_again(tmp_path, layout):
    """A recomputed layer's forward runs again in backward with the masks of the first run (the
    seed kept): from the same random state, training equals the plan without recomputation."""
    plain, again = _ranks("tp", tmp_path), _ranks(layout, tmp_path)
    for a, b in zip(again, plain):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        for name, value in b["replicated"].items():
            torch.testing.assert_close(a["replicated"][name], value, rtol=1e-5, atol=1e-6)
