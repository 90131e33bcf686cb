"""Dying ranks: fail loudly, quickly, and say who died where.

A rank that dies or hangs leaves the others waiting in a collective. Under torchrun's agent (what
`autopar train` launches) the agent sees a dead process within `monitor_interval` and stops the
others; where no agent sees it (another host, a rank that hangs) every collective gives up after
the timeout (`parallelize(timeout=...)`, `autopar train --timeout`, set on every group the plan
made: `set_timeouts`), and the step raises `PeerLost` instead of the backend's transport error. Each rank records its progress in a
small file, so the launcher can name the step at which a rank died (and an outside observer, such
as `benchmarks/chaos.py`, can find the ranks' processes).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from autopar.errors import AutoparError

# what gloo and NCCL say when a peer is gone or silent
_LOST = ("Timed out", "timed out", "Connection closed by peer", "Connection reset", "Broken pipe",
         "NCCL communicator was aborted", "ProcessGroupNCCL")


class PeerLost(AutoparError):
    """A collective failed because another rank died or stopped responding."""


@contextlib.contextmanager
def collective_failures(what: str) -> Iterator[None]:
    """Turn a transport error of a dead or silent peer into one clear `PeerLost`."""
    try:
        yield
    except RuntimeError as exc:
        if not (isinstance(exc, dist.DistError) or any(s in str(exc) for s in _LOST)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else "?"
        detail = str(exc).strip().splitlines()[0]
        raise PeerLost(f"rank {rank} gave up in {what}: another rank died or stopped responding "
                       f"({detail.split('] ', 1)[-1]})") from None


def set_timeouts(timeout_s: float) -> None:
    """Every process group this rank is in gives up after `timeout_s`: the groups DeviceMesh and the
    pipeline make (data, tensor, stage pairs, tied weights) otherwise wait torch's 30-minute
    default, whatever timeout the job was started with."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        with contextlib.suppress(ValueError):  # a group this rank is not in
            _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)


def guarded(step: Callable) -> Callable:
    """A model's `step` that raises `PeerLost` when a peer dies under it."""
    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        with collective_failures("a training step"):
            return step(*args, **kwargs)

    return run


def record(directory: str | Path, rank: int, step: int, phase: str, error: str | None = None) -> None:
    """This rank is at `step` doing `phase`, or failed there with `error` (replaced atomically:
    readers never see half a file)."""
    path = Path(directory) / f"rank{rank}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "phase": phase, "time": time.time(),
                               "error": error}))
    os.replace(tmp, path)


def progress(directory: str | Path, rank: int) -> dict[str, Any] | None:
    """What `record` last wrote for `rank`, or None."""
    try:
        return json.loads((Path(directory) / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def descends(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is `ancestor` or one of its descendants (not a stale file's reused pid)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


@contextlib.contextmanager
def reaping(directory: str | Path, nproc: int, grace_s: float) -> Iterator[None]:
    """While the body runs: once a rank records a failure, SIGKILL this process's ranks still alive
    `grace_s` later. torch's launcher SIGTERMs them and waits 30 s before it SIGKILLs; a frozen
    rank (stopped, or stuck in native code) never takes the SIGTERM."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            if any((p or {}).get("error") for p in (progress(directory, r) for r in range(nproc))):
                if stop.wait(grace_s):
                    return
                for where in (progress(directory, r) for r in range(nproc)):
                    if where and descends(where["pid"], os.getpid()):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(where["pid"], signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def dead_rank(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that failed first among torchelastic's `ProcessFailure`s. A rank killed by a signal
    is the cause; ranks whose collectives then failed are its consequences."""
    signalled = {r: f for r, f in failures.items() if f.exitcode < 0}
    pool = signalled or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def describe(rank: int, failure: Any, where: dict[str, Any] | None, steps: int) -> str:
    """One line: which rank died, how, and at which step."""
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    elif where and where.get("error"):
        how = f"failed ({where['error']})"
    else:
        how = f"exited with status {failure.exitcode}"
    if where is None:
        at = "before its first step"
    elif where["phase"] == "checkpoint":
        at = f"while saving the checkpoint of step {where['step']}"
    else:
        at = f"at step {where['step']} of {steps}"
    return f"rank {rank} {how} {at}; the other ranks were stopped"
