"""What hostile or broken input must not do: run code, listen beyond loopback, delete what the
project did not make, block recovery, or end in a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autopar


def _listeners(pids: set[int]) -> set[tuple[str, int]]:
    """(local address, port) of every TCP socket listening in `pids`, from /proc."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # gone meanwhile
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


def _tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc writes them


def test_a_local_job_listens_on_loopback_only():
    job = subprocess.Popen([sys.executable, "-m", "autopar", "train", "mlp-tiny", "--nproc", "2", "--steps", "200",
                            "--plan", "2,1,1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, int]] = set()
    while job.poll() is None:
        seen |= _listeners(_tree(job.pid))
        time.sleep(0.2)
    assert job.returncode == 0, job.stderr.read()
    assert len({port for _, port in seen}) >= 3  # the store and each rank's gloo pairs
    assert {address for address, _ in seen} <= LOOPBACK, seen


def _train(*argv):
    return subprocess.run([sys.executable, "-m", "autopar", "train", "mlp-tiny", "--nproc", "2", *argv],
                          capture_output=True, text=True, timeout=300)


class _Payload:
    """Unpickling this runs `open(path, "w")`: what a planted checkpoint file would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoints_resist_damage_planted_code_and_keep_user_files(tmp_path):
    import json

    import torch

    from autopar.runtime import checkpoint

    ck = tmp_path / "ck"
    (ck / "notes.partial").mkdir(parents=True)
    (ck / "notes.partial" / "important.txt").write_text("mine")
    common = ["--steps", "4", "--checkpoint-dir", str(ck), "--plan", "2,1,1", "--json"]
    straight = _train(*common, "--checkpoint-every", "2")
    assert straight.returncode == 0, straight.stderr
    assert (ck / "notes.partial" / "important.txt").read_text() == "mine"  # not ours: left alone, and said
    assert "notes.partial, which autopar did not make: left alone" in straight.stderr

    # the newest checkpoint truncated: --resume falls back to the intact one, on the same trajectory
    shard = next(p for p in sorted((ck / "step-4").iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-10])
    resumed = _train(*common, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping checkpoint {ck / 'step-4'}: {shard} has" in resumed.stderr
    assert f"resumed from {ck / 'step-2'} at step 2" in resumed.stderr
    assert json.loads(resumed.stdout)["losses"] == json.loads(straight.stdout)["losses"]

    # --resume-from names one; a damaged one is refused with the file
    chosen = _train(*common, "--resume-from", "step-2")
    assert chosen.returncode == 0 and f"resumed from {ck / 'step-2'} at step 2" in chosen.stderr, chosen.stderr
    shard = next(p for p in sorted((ck / "step-2").iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    refused = _train(*common, "--resume-from", "step-2")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"--resume-from step-2: {shard} does not match its SHA-256" in refused.stderr

    # code planted in a rank's state, the manifest rewritten to match: refused, never run
    newest = checkpoint.latest(ck)
    pwned = tmp_path / "pwned"
    torch.save({"rng": _Payload(str(pwned))}, newest / "rank0.pt")
    checkpoint._write_manifest(newest, checkpoint.step_of(newest))
    planted = _train(*common, "--resume", "--steps", "5")
    assert not pwned.exists()
    assert planted.returncode == 2 and "Traceback" not in planted.stderr
    assert f"{newest / 'rank0.pt'} holds something other than tensors and plain values" in planted.stderr


BOOM = """
import os
import torch

def make():  # fails on one rank only: the other must not wait for it
    if os.environ.get("RANK") == "1":
        raise RuntimeError("boom on rank 1")
    return torch.nn.Linear(4, 4), (torch.randn(8, 4),), lambda out, t: ((out - t) ** 2).mean(), \\
        lambda b, g: ((torch.randn(b, 4, generator=g),), torch.randn(b, 4, generator=g))
"""


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    """Broken inputs the cases below name: plans and clusters as a careless or hostile hand makes them."""
    import json
    import re

    from autopar.cost_models import get_cluster
    from autopar.planner.auto import plan_auto
    from autopar.planner.search import Search

    tmp_path = tmp_path_factory.mktemp("broken")
    w = autopar.load_workload("mlp-tiny")  # the suite's batch, as `autopar train mlp-tiny` runs it
    plan = json.loads(plan_auto(Search.start(w, get_cluster("cpu-local"), (1, 2))).to_json())
    (tmp_path / "needs.json").write_text(json.dumps({**plan, "stages": [{**plan["stages"][0], "needs": [1]}]}))
    (tmp_path / "digits.json").write_text(re.sub(r'"batch": \d+', '"batch": ' + "9" * 5000, json.dumps(plan)))
    (tmp_path / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "binary.json").write_bytes(bytes(range(256)) * 4)
    evil = {**plan, "model": "mlp[bold red]X[/]\x1b[2J\x07", "cluster": "/dev/zero"}
    (tmp_path / "zero.json").write_text(json.dumps(evil))
    (tmp_path / "evil.json").write_text(json.dumps({**evil, "cluster": "cpu-local"}))
    many = {**plan, "num_microbatches": 10**8, "batch": 10**8}
    (tmp_path / "many.json").write_text(json.dumps(many))
    huge = get_cluster("a100-dgx").to_dict()
    huge["device"]["memory_bytes"] = 10**400
    (tmp_path / "huge-cluster.json").write_text(json.dumps(huge))
    (tmp_path / "afile").write_text("")
    op = next(iter(plan["stages"][0]["ops"]))
    s99 = {**plan, "stages": [{**plan["stages"][0], "ops": {**plan["stages"][0]["ops"], op: ["R", "S(99)"]}}]}
    (tmp_path / "s99.json").write_text(json.dumps(s99))
    (tmp_path / "boom.py").write_text(BOOM)
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["show", "{tmp}/needs.json"], "needs must be an object, got [1]"),
    (["show", "{tmp}/digits.json"], "digits: too large for any field"),
    (["show", "{tmp}/nested.json"], "nested"),
    (["show", "{tmp}/binary.json"], "is not text (UTF-8 JSON)"),
    (["show", "{tmp}/many.json"], "must be at most 2147483648 and 65536"),
    (["clusters", "{tmp}/huge-cluster.json"], "digits: too large for any field"),
    (["plan", "mlp-tiny", "--mesh", "100000x8"], "autopar plans at most 16384 devices"),
    (["plan", "mlp-tiny", "--mesh", "1x2", "--batch", str(2**70)], "--batch must be a positive integer of at most"),
    (["plan", "mlp-tiny", "--mesh", "1x2", "--compression", "powersgd:nan"], "values must be finite numbers"),
    (["plan", "mlp-tiny", "--mesh", "1x2", "--compression", "powersgd:inf"], "values must be finite numbers"),
    (["plan", "mlp-tiny", "--mesh", "1x2", "--out", "{tmp}"], "--out {tmp} is a folder: give a file name"),
    (["plan", "mlp-tiny", "--mesh", "1x2", "--out", "{tmp}/missing/plan.json"], "the folder {tmp}/missing does not exist"),
    (["train", "mlp-tiny", "--nproc", "2", "--checkpoint-dir", "{tmp}/afile"], "is a file, not a folder"),
    (["train", "mlp-tiny", "--nproc", "2", "--timeout", "1e15"], "--timeout must be a positive number of seconds"),
    (["train", "mlp-tiny", "--nproc", "2", "--plan", "{tmp}/s99.json"], "S(99) splits dimension 99 of a tensor with"),
    (["train", "{tmp}/boom.py:make", "--nproc", "2", "--steps", "1"], "calling make() failed: RuntimeError: boom on rank 1"),
    (["train", "mlp-tiny", "--nproc", "2", "--plan", "2,1,1", "--steps", "1", "@AUTOPAR_EMULATE_LINK=abc"],
     "AUTOPAR_EMULATE_LINK='abc': write latency_s[,bytes_per_s]"),
])
def test_broken_input_is_one_message_with_exit_2(argv, message, broken):
    tmp_path = broken
    env = dict(os.environ)
    for a in [a for a in argv if a.startswith("@")]:
        key, _, value = a[1:].partition("=")
        env[key] = value
    argv = [a.format(tmp=tmp_path) for a in argv if not a.startswith("@")]
    proc = subprocess.run([sys.executable, "-m", "autopar", *argv], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 2, proc.stderr
    assert message.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr


def test_names_from_files_are_printed_literally(broken):
    tmp_path = broken
    proc = subprocess.run([sys.executable, "-m", "autopar", "show", str(tmp_path / "evil.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "mlp[bold red]X[/]\\x1b[2J\\x07" in proc.stdout and "\x1b" not in proc.stdout
    # its cluster named as /dev/zero: not read (a device), drawn without the memory line, at once
    proc = subprocess.run([sys.executable, "-m", "autopar", "show", str(tmp_path / "zero.json"), "--png",
                           str(tmp_path / "z.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "z.png").stat().st_size > 0, proc.stderr
