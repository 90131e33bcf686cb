"""Dying ranks: fail loudly, quickly, and say who died where.

A rank that dies or hangs leaves the others waiting in a collective. Under torchrun's agent (what
`autopar train` launches) the agent sees a dead process within `monitor_interval` and stops the
others; where no agent sees it (another host, a rank that hangs) every collective gives up after
the timeout (`parallelize(timeout=...)`, `autopar train --timeout`, set on every group the plan
made: `set_timeouts`), and the step raises `PeerLost` instead of the backend's transport error;
`reaping` then ends the ranks that are left and notes who was dead or frozen, for `blame`. Each rank records its progress in a
small file, so the launcher can name the step at which a rank died (and an outside observer, such
as `benchmarks/chaos.py`, can find the ranks' processes).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
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
_LOST = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
         "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


class PeerLost(AutoparError):
    """A collective failed because another rank died or stopped responding."""


@contextlib.contextmanager
def collective_failures(what: str) -> Iterator[None]:
    """Turn a transport error of a dead or silent peer into one clear `PeerLost`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (RuntimeError, CheckpointException) as exc:  # DCP gathers its ranks' errors into the latter
        text = str(exc)
        if not (isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)) or any(s in text for s in _LOST)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else "?"
        detail = next((line for line in text.splitlines() if any(s in line for s in _LOST)), text.strip())
        raise PeerLost(f"rank {rank} gave up in {what}: another rank died or stopped responding "
                       f"({detail.split('] ', 1)[-1].strip()})") from exc


def set_timeouts(timeout_s: float) -> None:
    """Every process group this rank is in gives up after `timeout_s`: the groups DeviceMesh and the
    pipeline make (data, tensor, stage pairs, tied weights) otherwise wait torch's 30-minute
    default, whatever timeout the job was started with."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout, _world
    except ImportError:  # a torch without it: the job's own timeout still holds for the default group
        logging.getLogger(__name__).warning("this torch cannot set process-group timeouts: subgroups wait "
                                            "torch's default")
        return
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


def _process_state(pid: int) -> str:
    """"dead" (gone, or a zombie not yet reaped), "stopped" (SIGSTOP, a debugger) or "running"."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "dead"
    return {"Z": "dead", "X": "dead", "T": "stopped", "t": "stopped"}.get(state, "running")


def _lost(where: dict[str, Any] | None) -> bool:
    """The rank recorded that a peer was lost (a consequence, not a cause)."""
    return bool(where and where.get("error") and "another rank died or stopped responding" in where["error"])


@contextlib.contextmanager
def reaping(directory: str | Path, nproc: int, grace_s: float, seen: dict[int, tuple[str, dict | None]]
            ) -> Iterator[None]:
    """While the body runs: once a rank records a failure, note every rank's process state and
    progress in `seen` (what `blame` reads: by the time the launcher reports, every rank is gone),
    and SIGKILL the ranks that recorded nothing and are still there `grace_s` later: torch's
    launcher SIGTERMs them and waits 30 s, and a frozen rank never takes the SIGTERM."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            where = {r: progress(directory, r) for r in range(nproc)}
            if not any((w or {}).get("error") for w in where.values()):
                continue
            seen.update({r: (_process_state(w["pid"]) if w else "dead", w) for r, w in where.items()})
            if stop.wait(grace_s):
                return
            for w in (progress(directory, r) for r in range(nproc)):
                if w and not w.get("error") and descends(w["pid"], os.getpid()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w["pid"], signal.SIGKILL)
            return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def blame(failed: dict[int, Any], seen: dict[int, tuple[str, dict | None]], directory: str | Path,
          steps: int) -> str:
    """One line: which rank died (or froze), how, and at which step. torchelastic reports the first
    rank it saw exit, which may be one whose collectives failed because of another; the causes
    come first: a rank that died without a word, a frozen one, a signalled one, a rank's own error."""
    where = {r: w for r, (_, w) in seen.items()} or {r: progress(directory, r) for r in failed}
    state = {r: st for r, (st, _) in seen.items()}
    dead = [r for r, st in state.items() if st == "dead" and not (where[r] or {}).get("error")]
    frozen = [r for r, st in state.items() if st == "stopped"]
    signalled = [r for r, f in failed.items() if f.exitcode < 0 and not (where.get(r) or {}).get("error")]
    own = [r for r in failed if (where.get(r) or {}).get("error") and not _lost(where.get(r))]
    rank = (dead or frozen or signalled or own or sorted(failed))[0]
    w = where.get(rank) or progress(directory, rank)
    if rank in frozen:
        how = "stopped responding (its process is stopped)"
    elif w and w.get("error") and not (rank in signalled):
        how = f"failed ({w['error']})"
    elif rank in failed and failed[rank].exitcode < 0:
        how = f"was killed by {failed[rank].signal_name()}"
    elif rank in dead:
        how = "died"
    else:
        how = f"exited with status {failed[rank].exitcode}"
    if w is None:
        at = "before its first step"
    elif w["phase"] == "checkpoint":
        at = f"while saving the checkpoint of step {w['step']}"
    elif w["phase"] == "resume":
        at = f"while loading the checkpoint of step {w['step']}"
    else:
        at = f"at step {w['step']} of {steps}"
    return f"rank {rank} {how} {at}; the other ranks were stopped"
