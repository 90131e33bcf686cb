"""Dying and hanging ranks: the job stops within a bounded time and says which rank, at which step;
checkpoints let `autopar train --resume` continue the same trajectory."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch.multiprocessing as mp

DYING = textwrap.dedent('''
    import os, signal, time
    import torch.distributed as dist
    import autopar

    def make():
        w = autopar.load_workload("mlp-tiny", batch=8, device="cpu")
        calls = [0]
        def make_batch(batch, gen):
            if dist.get_rank() == 1 and calls[0] == int(os.environ["DIE_AT"]):
                with open(os.environ["DIE_LOG"], "w") as f:
                    f.write(str(time.time()))
                if os.environ["DIE_HOW"] == "raise":
                    raise ValueError("the data loader broke")
                os.kill(os.getpid(), signal.SIGSTOP if os.environ["DIE_HOW"] == "freeze" else signal.SIGKILL)
            calls[0] += 1
            return w.make_batch(batch, gen)
        return w.model, w.example_inputs, w.loss_fn, make_batch
''')


def _train(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "autopar", "train", *argv], capture_output=True, text=True, check=False,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("how, said, within", [
    ("kill", "rank 1 was killed by SIGKILL at step 2 of 5", 15),
    ("raise", "rank 1 failed (ValueError: the data loader broke) at step 2 of 5", 15),
    # frozen: rank 0's collectives give up after --timeout 5, and rank 1 is named from its process state
    ("freeze", "rank 1 stopped responding (its process is stopped) at step 2 of 5", 5 + 15),
])
def test_a_dying_rank_stops_the_job_and_is_named_with_its_step(tmp_path, how, said, within):
    (tmp_path / "dying.py").write_text(DYING)
    log = tmp_path / "died"
    proc = _train(f"{tmp_path}/dying.py:make", "--nproc", "2", "--steps", "5", "--checkpoint-dir", str(tmp_path / "ck"),
                  "--checkpoint-every", "1", "--timeout", "5",
                  env={"DIE_AT": "2", "DIE_LOG": str(log), "DIE_HOW": how})
    stopped = time.time() - float(log.read_text())
    assert proc.returncode == 2
    assert f"error: {said}" in proc.stderr
    assert "; the other ranks were stopped; the latest checkpoint is" in proc.stderr
    assert "step-2: run again with --resume" in proc.stderr
    assert "Traceback" not in proc.stderr
    # the agent notices a death within 0.1 s, a freeze after the timeout; the rest is teardown
    assert stopped < within


def _hung(rank, store, out, plan, world):
    """Rank 1 stops answering after one step; the others' next step must give up after the timeout."""
    # as torchrun starts a rank: the launcher serves the store, every rank joins it as a client
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=store, TORCHELASTIC_USE_AGENT_STORE="True")
    import autopar
    from autopar.runtime.failures import PeerLost

    w = autopar.load_workload("mlp-tiny", batch=8, device="cpu")
    pm = autopar.parallelize(w.model, None, w.example_inputs, loss_fn=w.loss_fn, plan=plan, timeout=3,
                             optimizer=lambda ps: __import__("torch").optim.SGD(ps, lr=0.1))
    import torch

    gen = torch.Generator().manual_seed(0)
    pm.step(*w.make_batch(8, gen))
    if rank == 1:
        time.sleep(12)  # hangs (then leaves without a word)
        os._exit(0)
    start = time.time()
    try:
        pm.step(*w.make_batch(8, gen))
        result = {"error": None}
    except PeerLost as exc:
        result = {"error": str(exc)}
    result["waited_s"] = time.time() - start
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    os._exit(0)


# on 4 ranks the pipeline's data-parallel pairs are groups of their own (not the job's): they time out too
@pytest.mark.parametrize("plan, world", [("2,1,1", 2), ("2,1,2,2", 4)], ids=["dp", "dp-pipeline"])
def test_a_hanging_rank_makes_the_others_fail_after_the_timeout(tmp_path, plan, world):
    from autopar.runtime.backend import local_store

    out = tmp_path / "rank0.json"
    with local_store() as port:
        mp.spawn(_hung, args=(str(port), str(out), plan, world), nprocs=world, join=True)
    result = json.loads(out.read_text())
    assert result["error"] and result["error"].startswith(
        "rank 0 gave up in a training step: another rank died or stopped responding")
    assert 2.5 < result["waited_s"] < 8  # the 3 s timeout, not the 12 s hang


def test_train_resumes_from_its_checkpoint_on_the_same_trajectory_and_under_another_plan(tmp_path):
    ck = tmp_path / "ck"
    common = ["mlp-tiny", "--nproc", "2", "--steps", "4", "--checkpoint-dir", str(ck), "--json"]
    straight = _train(*common, "--checkpoint-every", "2", "--plan", "2,1,1")
    assert straight.returncode == 0, straight.stderr
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]
    again = _train(*common, "--plan", "2,1,1")  # without --resume: the old run's checkpoints would take over
    assert again.returncode == 2 and "already holds checkpoints (up to step-4): pass --resume" in again.stderr
    short = _train(*common[:4], "1", *common[5:], "--resume")
    assert short.returncode == 2 and "step-4 is at step 4, beyond --steps 1" in short.stderr
    (ck / "step-4").rename(tmp_path / "away")  # as if the job had died during step 3
    resumed = _train(*common, "--resume", "--plan", "2,1,1")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ck / 'step-2'} at step 2" in resumed.stderr
    first, again = json.loads(straight.stdout), json.loads(resumed.stdout)
    assert again["start_step"] == 2 and again["losses"] == first["losses"]  # exactly
    (ck / "step-4").rename(tmp_path / "away-2")
    moved = _train(*common, "--resume", "--plan", "1,2,1")  # tensor parallel from the data-parallel checkpoint
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["losses"] == pytest.approx(first["losses"], rel=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir DIR"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["--checkpoint-dir", "{tmp}/ck", "--checkpoint-every", "-1"], "--checkpoint-every must be ≥ 0 steps, got -1"),
])
def test_bad_train_options_are_one_message(tmp_path, argv, message):
    proc = _train("mlp-tiny", "--nproc", "2", *[a.format(tmp=tmp_path) for a in argv])
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_blame_names_the_killed_rank_when_the_ranks_it_took_down_are_seen_gone_in_the_same_poll():
    """The launcher SIGTERMs rank 0 right after rank 1 is killed; a busy machine can note both gone
    in one poll, rank 0 first. The killed rank is the cause."""
    import signal as signals
    from types import SimpleNamespace

    from autopar.runtime.failures import Watched, blame

    where = {"pid": 1, "step": 2, "phase": "step"}
    killed = SimpleNamespace(exitcode=-signals.SIGKILL, signal_name=lambda: "SIGKILL")
    seen = {0: Watched(where=where, died_at=7), 1: Watched(where=where, died_at=7)}
    assert blame({1: killed}, seen, 5).startswith("rank 1 was killed by SIGKILL at step 2 of 5")
    # a rank seen gone a poll earlier, without a word, is still the first cause
    seen[0].died_at = 6
    assert blame({1: killed}, seen, 5).startswith("rank 0 died at step 2 of 5")


def test_blame_never_names_a_rank_stopped_for_another_ranks_error():
    """Rank 1 raised and recorded its error; on a loaded machine the launcher is slow to notice, so
    `reaping` kills rank 0 (waiting in a collective) itself, and it is seen gone first, without a
    word. Rank 1's error is the cause."""
    import signal as signals
    from types import SimpleNamespace

    from autopar.runtime.failures import Watched, blame

    where = {"pid": 1, "step": 2, "phase": "step"}
    killed = SimpleNamespace(exitcode=-signals.SIGKILL, signal_name=lambda: "SIGKILL")
    raised = SimpleNamespace(exitcode=1, signal_name=lambda: "")
    seen = {0: Watched(where=where, died_at=6, reaped=True),
            1: Watched(where={**where, "error": "ValueError: the data loader broke"}, died_at=7)}
    assert blame({0: killed, 1: raised}, seen, 5).startswith(
        "rank 1 failed (ValueError: the data loader broke) at step 2 of 5")


def test_blame_names_a_ranks_own_error_the_launcher_did_not_report():
    """Under load the launcher may report only rank 0, which lost its peer in a barrier; rank 1's
    where-file holds its own error. Rank 1's error is the cause."""
    from types import SimpleNamespace

    from autopar.runtime.failures import Watched, blame

    where = {"pid": 1, "step": 2, "phase": "step"}
    lost = SimpleNamespace(exitcode=1, signal_name=lambda: "")
    seen = {0: Watched(where={**where, "error": "PeerLost: gave up in the barrier", "peer": True}, died_at=7),
            1: Watched(where={**where, "error": "ValueError: the data loader broke"}, died_at=7)}
    assert blame({0: lost}, seen, 5).startswith(
        "rank 1 failed (ValueError: the data loader broke) at step 2 of 5")


def _failing(rank, world, out, where):
    """Rank 0 fails while planning, or rank 1 while building or at its second step; each rank writes
    what it raised. Ranks leave with status 0 (the spawn would stop the others at once otherwise)."""
    import torch
    import torch.distributed as dist

    import autopar
    import autopar.api

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    w = autopar.load_workload("mlp-tiny", batch=8, device="cpu")
    if where == "planning" and rank == 0:
        def broken(*args, **kwargs):
            raise RuntimeError("the solver broke")
        autopar.api._resolve = broken
    if where == "building" and rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("this rank's device is gone")
        autopar.api._build = broken
    armed = [False]

    def hook(module, args):
        if armed[0] and rank == 1:
            raise ValueError("the data loader broke")

    w.model.register_forward_pre_hook(hook)
    gen = torch.Generator().manual_seed(0)
    said = None
    try:
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan="2,1,1",
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        pm.step(*w.make_batch(8, gen))
        armed[0] = where == "step"
        pm.step(*w.make_batch(8, gen))
    except Exception as exc:  # noqa: BLE001 - what the test reads
        said = [type(exc).__name__, str(exc)]
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(said, f)
    os._exit(0)


@pytest.mark.parametrize("where, rank, said", [
    ("planning", 0, "rank 0 failed in planning: RuntimeError: the solver broke"),
    ("building", 1, "rank 1 failed in building the model: RuntimeError: this rank's device is gone"),
    ("step", 1, "rank 1 failed in a training step: ValueError: the data loader broke"),
])
def test_one_ranks_error_is_every_ranks_error(tmp_path, where, rank, said):
    """The failing rank raises its own error; the other, instead of a transport error ("Connection
    closed by peer") or a hang, raises `PeerFailed` naming that rank and its message."""
    mp.spawn(_failing, args=(2, str(tmp_path), where), nprocs=2, join=True)
    errors = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    own, other = errors[rank], errors[1 - rank]
    assert own[1] in said and own[0] in ("RuntimeError", "ValueError")
    assert other == ["PeerFailed", said]
