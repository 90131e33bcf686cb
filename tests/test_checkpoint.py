"""Checkpoints on 4 gloo ranks: a resumed run continues the exact trajectory, and a checkpoint
saved under one plan loads under another with identical parameters."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.contract.placements import Shard
from autopar.runtime import checkpoint
from tests.distributed import on_rank0, run_ranks, shared_ranks
from tests.test_compression import slow_link
from tests.test_parallelize import _layout, _workload

WORLD = 4


def _adam(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _directory() -> str:
    """One new directory every rank of the job writes to."""
    return on_rank0(lambda: tempfile.mkdtemp(prefix="autopar-ckpt-"))


def _plan(w, layout: str):
    """A layout "DP,TP,PP[,MB]"; "zero3:" before it shards every parameter over the data axis."""
    if not layout.startswith("zero3:"):
        return layout
    plan = _layout(w, WORLD, layout.removeprefix("zero3:"))
    for stage in plan.stages:
        stage.params = {f: [Shard(0), p[1]] for f, p in stage.params.items()}
    return plan


def _parallelize(name, layout, seed=0, **kw):
    w, batches = _workload(name)
    if seed:  # other initial weights: only the checkpoint can make the runs agree
        torch.manual_seed(seed)
        for p in w.model.parameters():
            torch.nn.init.normal_(p, std=0.5)
    pm = autopar.parallelize(w.model, (1, WORLD), w.example_inputs, loss_fn=w.loss_fn, optimizer=_adam,
                             plan=_plan(w, layout), **kw)
    return pm, batches


def _buffers(pm) -> dict[str, torch.Tensor]:
    """The model's persistent buffers, from the ranks holding them (pipeline stages hold theirs)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {n: b.detach().cpu().clone() for n, b in pm.state_buffers.items()})
    return {n: b for part in parts for n, b in part.items()}


def _moved(rank, world, name, saved, loaded):
    """Two steps under `saved`, a checkpoint; a fresh model under `loaded` loads it."""
    directory = _directory()
    pm, batches = _parallelize(name, saved)
    for inputs, target in batches[:2]:
        pm.step(inputs, target)
    path = checkpoint.save(pm, directory, 2, {"note": "moved"})
    before = {**pm.full_state_dict(), **_buffers(pm)}
    next_loss = pm.step(*batches[2])  # what the saved layout does next
    other, _ = _parallelize(name, loaded, seed=7)
    for b in other.state_buffers.values():  # other running statistics: only the checkpoint can restore them
        b.add_(1)
    trainer = checkpoint.load(other, path)
    after = {**other.full_state_dict(), **_buffers(other)}
    return before, after, trainer, next_loss, other.step(*batches[2])


MOVES = [("gpt-tiny", "1,4,1", "2,1,2,2"), ("gpt-tiny", "2,1,2,2", "1,4,1"),
         ("mlp-tiny", "zero3:4,1,1", "2,2,1"), ("gpt-tiny", "2,2,1", "1,2,2,2"),
         ("wresnet-tiny", "4,1,1", "2,1,2"), ("wresnet-tiny", "2,1,2", "1,4,1")]


@pytest.mark.parametrize("name, saved, loaded", MOVES)
def test_a_checkpoint_saved_under_one_plan_loads_under_another(tmp_path, name, saved, loaded):
    """Parameters, optimizer moments and BatchNorm's running statistics move between layouts."""
    for before, after, trainer, next_loss, loss in shared_ranks(_moved, WORLD, MOVES, (name, saved, loaded), tmp_path):
        assert trainer == {"step": 2, "note": "moved", "exact": False}  # another layout: own state afresh
        assert after.keys() == before.keys()
        assert name != "wresnet-tiny" or any("running_mean" in k for k in before)
        for key, value in before.items():
            assert torch.equal(after[key], value), key  # bit for bit
        # the optimizer's moments moved too: the next step agrees up to summation order (BatchNorm
        # normalises each replica's microbatch: another data-parallel split gives another loss)
        assert name == "wresnet-tiny" or loss == pytest.approx(next_loss, rel=1e-4)


def _resumed(rank, world, name, layout, compression, delay):
    """Four steps straight, against two steps, a checkpoint, a new job's model loading it, two more."""
    # a compressor planned for 100 Mb/s (on loopback it would compress nothing), from the first step
    kw = {"compression": compression, "delay": delay,
          "cluster": slow_link(Path(tempfile.mkdtemp()), world) if compression else None}
    pm, batches = _parallelize(name, layout, **kw)
    straight = [pm.step(*b) for b in batches + batches[:1]]
    directory = _directory()
    first, _ = _parallelize(name, layout, **kw)
    losses = [first.step(*b) for b in batches[:2]]
    checkpoint.save(first, directory, 2)
    checkpoint.save(first, directory, 2)  # saving a step again replaces it
    second, _ = _parallelize(name, layout, seed=3, **kw)
    trainer = checkpoint.load(second, checkpoint.latest(directory))
    losses += [second.step(*b) for b in batches[2:] + batches[:1]]
    return straight, losses, (trainer["step"], trainer["exact"]), pm.full_state_dict(), second.full_state_dict()


RESUMED = [("gpt-tiny", "2,1,2,2", None, 0), ("mlp-tiny", "2,2,1", "topk:0.05,warmup=0,min_size=0", 0),
           ("mlp-tiny", "4,1,1", "powersgd:2,start=1,min_size=0", 0), ("mlp-tiny", "4,1,1", None, 2)]


@pytest.mark.parametrize("name, layout, compression, delay", RESUMED)
def test_a_resumed_run_continues_the_exact_trajectory(tmp_path, name, layout, compression, delay):
    results = shared_ranks(_resumed, WORLD, RESUMED, (name, layout, compression, delay), tmp_path)
    for straight, losses, step, params, resumed_params in results:
        assert step == (2, True)
        assert losses == straight  # exactly: same data, same optimizer and compressor states
        for key, value in params.items():
            assert torch.equal(resumed_params[key], value), key


def _other_model(rank, world, directory):
    gpt, _ = _parallelize_on(1, "gpt-tiny")
    checkpoint.save(gpt, directory, 1)
    mlp, _ = _parallelize_on(1, "mlp-tiny")
    with pytest.raises(autopar.AutoparError) as info:
        checkpoint.load(mlp, checkpoint.latest(directory))
    return str(info.value)


def _parallelize_on(world, name):
    w, batches = _workload(name)
    return autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=_adam,
                               plan=f"{world},1,1"), batches


def test_a_checkpoint_of_another_model_is_one_clear_message(tmp_path):
    (message,) = run_ranks(_other_model, 1, tmp_path, str(tmp_path / "ck"))
    assert " holds no " in message and message.endswith("parameters): it was saved for another model")


def test_latest_skips_partial_and_damaged_checkpoints(tmp_path, caplog):
    def complete(name, step):
        (tmp_path / name).mkdir()
        (tmp_path / name / checkpoint.MARKER).write_text("")
        (tmp_path / name / ".metadata").write_bytes(b"meta")
        (tmp_path / name / "trainer.pt").write_bytes(b"trainer")
        checkpoint._write_manifest(tmp_path / name, step)

    complete("step-3", 3)
    complete("step-10", 10)
    complete("step-13", 13)
    (tmp_path / "step-13" / "trainer.pt").write_bytes(b"traine")  # truncated
    complete("step-14", 14)
    (tmp_path / "step-14" / "trainer.pt").write_bytes(b"TRAINER")  # same size, other bytes
    complete("step-15", 15)
    (tmp_path / "step-15" / "rank0.pt").write_bytes(b"planted")  # not in the manifest
    complete("step-16", 16)
    (tmp_path / "step-16" / checkpoint.MANIFEST).unlink()  # never finished
    (tmp_path / "step-12.partial").mkdir()  # a job killed while writing it
    (tmp_path / "step-11").mkdir()  # emptied by a deletion that was cut short
    complete("step-9.trash", 9)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-10"
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "step-13/trainer.pt has 6 bytes, its manifest says 7" in warned
    assert "step-14/trainer.pt does not match its SHA-256" in warned
    assert "step-15/rank0.pt is not in its manifest" in warned
    assert "step-16: no manifest.json" in warned
    assert checkpoint.latest(tmp_path / "absent") is None
