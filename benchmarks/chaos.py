"""Chaos: kill a random rank at a random moment, resume, again and again; count hangs and lost steps.

First an uninterrupted `autopar train` gives the reference loss trajectory. Then the same job runs
with `--checkpoint-every` and `--resume` while this script, from outside, SIGKILLs a random rank
(found through the ranks' progress files) once it reaches a random step — after a random delay, so
kills land in forward, backward, the optimizer step or a checkpoint being written. `--freezes` of
the kills SIGSTOP the rank instead: a hang the launcher's agent cannot see, which the others'
collective timeout (`--timeout`) must turn into an error. Each job must exit on its own within
`--hang-after` seconds (plus, after a freeze, the timeout and the launcher's grace before it
SIGKILLs what ignores SIGTERM), else it counts as a hang and is killed; a killed rank must be named. The next job resumes from the latest checkpoint. After `--kills`
kills the job runs to its end, and its losses (the checkpointed ones included) must equal the
reference exactly.

- lost steps: steps a complete checkpoint held when the job was killed, that the resumed job did
  not start from (from the "resumed from … at step N" it prints; must be 0);
- redone steps: steps run again after a resume (the work since the last checkpoint: at most
  `--checkpoint-every`).

`--corruptions` of the restarts first damage the newest checkpoint (truncate a file, change a byte
in it, or delete it): the resumed job must skip it and start from the newest intact one (counted
in "lost steps" otherwise), and the final trajectory must still equal the reference.

Prints the summary and writes it to docs/benchmarks/results/chaos.md (not with `--json`, whose
output is for programs).

    python benchmarks/chaos.py [--model gpt-tiny] [--plan 2,1,2,2] [--nproc 4] [--steps 30] [--kills 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _page import table, write
from _stamp import stamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.runtime import checkpoint, failures
from autopar.train import SHUTDOWN_GRACE_S


def _command(args, directory: Path | None, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "autopar", "train", args.model, "--nproc", str(args.nproc), "--steps",
           str(args.steps), "--plan", args.plan, "--timeout", str(args.timeout), "--json"]
    if directory is not None:
        cmd += ["--checkpoint-dir", str(directory), "--checkpoint-every", str(args.checkpoint_every)]
    return cmd + (["--resume"] if resume else [])


def _kill_one(proc: subprocess.Popen, progress: Path, rank: int, step: int, delay: float,
              sig: signal.Signals, limit_s: float) -> dict | None:
    """Send `sig` to `rank` once it reaches `step` (plus `delay` seconds): SIGKILL kills it, SIGSTOP
    freezes it (a hang no agent sees). None if the job ended first; {"stalled": True} if it got
    nowhere near the step within `limit_s`."""
    deadline = time.time() + limit_s
    while proc.poll() is None:
        if time.time() > deadline:
            return {"stalled": True}
        where = failures.progress(progress, rank)
        if where and where["step"] >= step and where["phase"] in ("step", "checkpoint"):
            time.sleep(delay)
            where = failures.progress(progress, rank)
            if where is None or not failures.descends(where["pid"], proc.pid):
                continue
            latest = checkpoint.latest(progress.parent)
            try:
                os.kill(where["pid"], sig)
            except ProcessLookupError:
                return None
            return {"signal": sig.name, "rank": rank, "step": where["step"], "phase": where["phase"], "at": time.time(),
                    "checkpointed": checkpoint.step_of(latest) if latest else 0}
        time.sleep(0.005)
    return None


def _damage(path: Path, rng: random.Random) -> str:
    """Truncate, change or delete one random file of the checkpoint at `path`; say which."""
    victim = rng.choice(sorted(p for p in path.iterdir() if p.is_file()))
    how = rng.choice(["truncate", "flip", "delete"])
    data = victim.read_bytes()
    if how == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif how == "flip" and data:
        i = rng.randrange(len(data))
        victim.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    else:
        victim.unlink()
    return f"{how} {path.name}/{victim.name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--plan", default="2,1,2,2", help="layout DP,TP,PP[,MB] (default: DP×PP with a tied embedding)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--freezes", type=int, default=2, help="of the kills, this many SIGSTOP a rank instead")
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=10.0, help="the ranks' collective timeout (--timeout)")
    parser.add_argument("--hang-after", type=float, default=60.0,
                        help="a job still running this long after a kill (after a freeze: plus the timeout and "
                             "the launcher's grace) is a hang")
    parser.add_argument("--run-limit", type=float, default=600.0, help="a job reaching no kill or end this long is a hang")
    parser.add_argument("--corruptions", type=int, default=4,
                        help="of the restarts, this many first damage the newest checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    status = (lambda text: print(text, file=sys.stderr)) if args.json else print

    stamped, started = stamp(), time.time()
    reference = subprocess.run(_command(args, None, False), capture_output=True, text=True, check=False)
    if reference.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{reference.stderr}")
    expected = json.loads(reference.stdout)["losses"]
    status(f"uninterrupted: {len(expected)} steps in {time.time() - started:.1f} s")

    directory = Path(tempfile.mkdtemp(prefix="autopar-chaos-"))
    kills, hangs, lost, redone, unnamed, runs = [], 0, 0, 0, 0, 0
    last_start = 0
    final = None
    targets = sorted(rng.randrange(args.steps) for _ in range(args.kills))  # kill steps, spread over the run
    frozen = set(rng.sample(range(args.kills), min(args.freezes, args.kills)))
    damaged = set(rng.sample(range(1, args.kills + 1), min(args.corruptions, args.kills)))  # before these restarts
    corruptions, fell_back = [], 0
    try:
        while final is None:
            runs += 1
            shutil.rmtree(directory / "progress", ignore_errors=True)  # no stale pids
            newest = checkpoint.latest(directory)
            if len(kills) in damaged and newest is not None and len(checkpoint._complete(directory)) > 1:
                damaged.discard(len(kills))
                corruptions.append(_damage(newest, rng))
                status(f"damaged: {corruptions[-1]}")
            begun = checkpoint.latest(directory)  # the newest intact one: where the job must resume
            start = checkpoint.step_of(begun) if begun else 0
            fell_back += begun != newest
            proc = subprocess.Popen(_command(args, directory, True), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            kill = None
            if len(kills) < args.kills:
                sig = signal.SIGSTOP if len(kills) in frozen else signal.SIGKILL
                kill = _kill_one(proc, directory / "progress", rng.randrange(args.nproc),
                                 max(start, targets[len(kills)]), rng.uniform(0.0, 0.3), sig, args.run_limit)
            try:
                grace = args.timeout + SHUTDOWN_GRACE_S if kill and kill.get("signal") == "SIGSTOP" else 0
                out, err = proc.communicate(timeout=(args.hang_after + grace) if kill else args.run_limit)
            except subprocess.TimeoutExpired:
                hangs += 1
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            resumed = re.search(r"resumed from \S*step-\d+ at step (\d+)", err)
            if kills:  # the resume must start at the newest intact checkpoint the previous kill left
                at = int(resumed.group(1)) if resumed else start  # killed before it said so
                lost += max(0, (start if begun != newest else kills[-1]["checkpointed"]) - at)
                redone += max(0, kills[-1]["step"] - at)
            if kill is not None and kill.get("stalled"):
                continue  # counted as a hang above: the job got nowhere within --run-limit
            if kill is None:
                if proc.returncode != 0:
                    raise SystemExit(f"run {runs} failed without a kill:\n{err}")
                final = json.loads(out)
                continue
            kill["exit_s"] = time.time() - kill.pop("at")
            kill["named"] = (f"rank {kill['rank']} was killed by SIGKILL" in err if kill["signal"] == "SIGKILL"
                             else f"rank {kill['rank']} stopped responding" in err)
            unnamed += not kill["named"]
            kill["said"] = next((line for line in err.splitlines() if line.startswith("error:")), err[-300:])
            kills.append(kill)
            status(f"{kill['signal']} {len(kills)}: rank {kill['rank']} at step {kill['step']} ({kill['phase']}), "
                   f"job exited {kill['exit_s']:.2f} s later, checkpoint step {kill['checkpointed']}")
            last_start = start
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {
        "model": args.model, "plan": args.plan, "nproc": args.nproc, "steps": args.steps,
        "checkpoint_every": args.checkpoint_every, "kills": len(kills), "runs": runs, "hangs": hangs,
        "lost_steps": lost, "redone_steps": redone, "kills_not_named": unnamed,
        "killed_in_checkpoint": sum(k["phase"] == "checkpoint" for k in kills),
        "freezes": sum(k["signal"] == "SIGSTOP" for k in kills),
        "max_exit_s": max((k["exit_s"] for k in kills if k["signal"] == "SIGKILL"), default=0.0),
        "max_exit_after_freeze_s": max((k["exit_s"] for k in kills if k["signal"] == "SIGSTOP"), default=0.0),
        "trajectory_equal": final["losses"] == expected, "last_resume_step": last_start,
        "corruptions": len(corruptions), "resumed_from_an_older_checkpoint": fell_back, "damage_log": corruptions,
        "wall_s": time.time() - started, "kill_log": kills,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    _report(args, result, stamped)


SUMMARY = ("kills", "freezes", "corruptions", "resumed_from_an_older_checkpoint", "runs", "hangs", "lost_steps",
           "redone_steps", "kills_not_named", "killed_in_checkpoint", "max_exit_s", "max_exit_after_freeze_s",
           "trajectory_equal", "wall_s")


def _report(args: argparse.Namespace, result: dict, stamped: dict) -> None:
    """The summary on the console (rich) and as the page fragment `chaos`."""
    from rich.console import Console
    from rich.table import Table

    heading = (f"chaos: {args.model}, plan {args.plan}, {args.nproc} ranks, {args.steps} steps, "
               f"checkpoint every {args.checkpoint_every}")
    rows = [[key, f"{result[key]:.2f}" if isinstance(result[key], float) else str(result[key])] for key in SUMMARY]
    console = Console()
    console.print(heading)
    grid = Table("measure", "value")
    for row in rows:
        grid.add_row(*row)
    console.print(grid)
    write("chaos", stamped, f"{heading}\n\n{table(['measure', 'value'], rows)}")


if __name__ == "__main__":
    main()
