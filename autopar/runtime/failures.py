"""Dying ranks: fail loudly, quickly, and say who died where.

A rank that dies or hangs leaves the others waiting in a collective. Under torchrun's agent (what
`autopar train` launches) the agent sees a dead process within `monitor_interval` and stops the
others. Where no agent sees it (another host, a rank that hangs), every collective gives up after
the timeout (`parallelize(timeout=...)`, `autopar train --timeout`, set on every group the plan
made: `set_timeouts`), and the step raises `PeerLost` instead of the backend's transport error.
Each rank records its progress (pid, step, phase, error) in a small file; `reaping` watches the
ranks' processes, ends those left behind, and `blame` names the one that died or froze and its
step (an outside observer, such as `benchmarks/chaos.py`, finds the ranks' processes there too).

A rank that raises instead (planning, building, stepping) leaves its message in the job's store
(`announce`), and the others, whose collectives then fail, raise `PeerFailed` naming that rank and
its words (`peer_failure`, `collective_failures`, `guarded`); checks that may come out differently
on different ranks run on all of them and are agreed before any collective (`agreed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from autopar.contract.errors import AutoparError

# what gloo and NCCL say when a peer is gone or silent
_LOST = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
         "Application timeout caused pair closure",
         "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


class PeerLost(AutoparError):
    """A collective failed because another rank died or stopped responding."""


class PeerFailed(PeerLost):
    """A collective failed because another rank raised an error: which rank, where, and its message
    (`user`: an `AutoparError`, what the user gave or a plan refused)."""

    def __init__(self, rank: int, where: str, message: str, user: bool) -> None:
        super().__init__(f"rank {rank} failed in {where}: {message}")
        self.rank, self.where, self.message, self.user = rank, where, message, user

    def __reduce__(self) -> tuple:  # sent between ranks
        return PeerFailed, (self.rank, self.where, self.message, self.user)


_FAILED = "autopar/failed/{scope}/{rank}"  # the job's store: why a rank failed, for the others to say


def told(exc: BaseException) -> tuple[str, bool]:
    """What another rank says of this error, and whether it was the user's (an `AutoparError`,
    repeated in its own words) or the program's (prefixed with its type)."""
    user = isinstance(exc, AutoparError)
    return (str(exc) if user else f"{type(exc).__name__}: {exc}"), user


def announce(scope: str | None, where: str, exc: BaseException) -> None:
    """Leave this rank's error where the others find it (the job's store) before it ends the rank:
    they will see a collective fail, and say this instead. `scope` tells the models one job builds apart."""
    store = _store()
    if store is None or scope is None or not dist.is_initialized():
        return
    message, user = told(exc)
    with contextlib.suppress(Exception):  # a store already gone: the others report the peer lost
        store.set(_FAILED.format(scope=scope, rank=dist.get_rank()), json.dumps(
            {"where": where, "message": message[:4000], "user": user}))


def peer_failure(scope: str | None) -> PeerFailed | None:
    """The error another rank announced in `scope`, if one did (the lowest rank's)."""
    store = _store()
    if store is None or scope is None or not dist.is_initialized():
        return None
    for rank in range(dist.get_world_size()):
        key = _FAILED.format(scope=scope, rank=rank)
        try:
            if rank != dist.get_rank() and store.check([key]):
                said = json.loads(store.get(key))
                return PeerFailed(rank, said["where"], said["message"], said["user"])
        except Exception:  # noqa: BLE001 - the store is gone too: the peer is only lost
            return None
    return None


def agreed(what: str, check: Callable[[], Any]) -> Any:
    """Run `check` on every rank and agree on it before anyone goes on: where it raises on any rank,
    every rank raises (its own error, or the first failing rank's as `PeerFailed`). For checks that
    may come out differently on different ranks, run before the collectives that would hang on it.
    A collective over the job."""
    result, failed = None, None
    try:
        result = check()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - every rank hears of it
        failed = exc
    if dist.get_world_size() == 1:
        if failed is not None:
            raise failed
        return result
    said: list = [None] * dist.get_world_size()
    dist.all_gather_object(said, None if failed is None else told(failed))
    if failed is not None:
        raise failed
    first = next(((r, s) for r, s in enumerate(said) if s is not None), None)
    if first is not None:
        rank, (message, user) = first
        raise PeerFailed(rank, what, message, user)
    return result


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_initialized() else None
    except (ImportError, RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def collective_failures(what: str, scope: str | None = None) -> Iterator[None]:
    """One rank's error is every rank's: this rank's own is announced (`announce`), and a transport
    error of a dead or silent peer becomes the error that peer announced (`PeerFailed`) or, where
    it announced none (killed, frozen), one clear `PeerLost`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except PeerLost:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP gathers its ranks' errors into CheckpointException
        text = str(exc)
        lost = isinstance(exc, (RuntimeError, CheckpointException)) and (
            isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)) or any(s in text for s in _LOST))
        if not lost:
            announce(scope, what, exc)
            raise
        cause = peer_failure(scope)
        if cause is not None:
            raise cause from exc
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


_CALLS = {"step": "a training step"}


def guarded(method: Callable) -> Callable:
    """A model's method that every rank calls together (`step`, `predict`): its error is announced
    to the others, and a peer's death or error under it raised as `PeerLost` / `PeerFailed`. Each
    call has a scope of its own (the ranks call in lockstep): an error a script caught and went on
    from is not blamed for a later one."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        scope = getattr(self, "failure_scope", None)
        self.calls = getattr(self, "calls", 0) + 1
        with collective_failures(_CALLS.get(method.__name__, f"{method.__name__}()"),
                                 scope and f"{scope}/{self.calls}"):
            return method(self, *args, **kwargs)

    return run


def record(directory: str | Path, rank: int, step: int, phase: str, error: str | None = None,
           user: bool = False, peer: bool = False) -> None:
    """This rank is at `step` doing `phase`, or failed there with `error` (`user`: an error in what
    the user gave, reported as it is; `peer`: another rank's death or error, not this rank's own)
    (replaced atomically: readers never see half a file)."""
    path = Path(directory) / f"rank{rank}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "phase": phase, "time": time.time(),
                               "error": error, "user": user, "peer": peer}))
    os.replace(tmp, path)


def user_error(directory: str | Path, ranks: int) -> str | None:
    """The first error in the user's input a rank recorded, if any."""
    return next((p["error"] for r in range(ranks) if (p := progress(directory, r)) and p.get("user")), None)


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


@dataclasses.dataclass
class Watched:
    """What `reaping` saw of one rank: its last progress, the poll in which its process was first
    seen gone (a poll, not a time: ranks noted gone in one poll went together, in no known order),
    whether it was seen stopped, whether `reaping` killed it itself (stopped for another rank's
    failure: never its cause)."""

    where: dict[str, Any] | None = None
    died_at: int | None = None
    stopped: bool = False
    reaped: bool = False


@contextlib.contextmanager
def reaping(directory: str | Path, nproc: int, grace_s: float, seen: dict[int, Watched]) -> Iterator[None]:
    """While the body runs, watch every rank's process (every 10 ms) and progress, into `seen`:
    `blame` reads it, as by the time the launcher reports every rank is gone, and the order in
    which they went tells the cause from the ranks the launcher stopped. Once a rank records a
    failure, SIGKILL `grace_s` later the ranks that recorded nothing: torch's launcher SIGTERMs
    them and waits 30 s, and a frozen rank never takes the SIGTERM."""
    stop = threading.Event()
    seen.update({r: Watched() for r in range(nproc)})

    def watch() -> None:
        failed_at, tick = None, 0
        while not stop.wait(0.01):
            tick += 1
            for r, w in seen.items():
                if w.died_at is not None:
                    continue
                if w.where is None or tick % 10 == 0:
                    w.where = progress(directory, r) or w.where
                if w.where is not None:
                    state = _process_state(w.where["pid"])
                    w.stopped |= state == "stopped"
                    if state == "dead":  # its last words (an error it recorded on the way out)
                        w.died_at, w.where = tick, progress(directory, r) or w.where
            if failed_at is None and any((w.where or {}).get("error") for w in seen.values()):
                failed_at = time.time()
            if failed_at is not None and time.time() > failed_at + grace_s:
                for w in seen.values():
                    if w.died_at is None and w.where and not w.where.get("error") \
                            and descends(w.where["pid"], os.getpid()):
                        w.reaped = True
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(w.where["pid"], signal.SIGKILL)
                failed_at = float("inf")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def blame(failed: dict[int, Any], seen: dict[int, Watched], steps: int) -> str:
    """One line: which rank died (or froze), how, and at which step. torchelastic reports the first
    rank it saw exit, which may be one whose collectives failed because of another, or one it
    stopped itself; the causes come first: a frozen rank, the first rank gone without a word, a
    signalled one, a rank's own error, before ranks that only lost a peer. Of ranks seen gone in the
    same poll, one the launcher saw killed by a signal goes first: the others are the ranks it
    stopped after it. A rank `reaping` killed itself is never a cause (on a loaded machine it may
    go before the launcher notices the failed rank)."""
    def error(r: int) -> str | None:
        return (seen[r].where or {}).get("error") if r in seen else None

    def reaped(r: int) -> bool:
        return r in seen and seen[r].reaped

    frozen = [r for r, w in seen.items() if w.stopped]
    signalled = [r for r, f in failed.items() if f.exitcode < 0 and not error(r) and not reaped(r)]
    silent = sorted((w.died_at, r not in signalled, r) for r, w in seen.items()
                    if w.died_at is not None and not error(r) and not w.reaped)
    # a rank's own error counts whether or not the launcher reported its exit: under load it may
    # report only a rank that lost its peer
    own = [r for r in [*failed, *sorted(set(seen) - set(failed))]
           if error(r) and not (seen[r].where or {}).get("peer")]
    rank = (frozen or [r for *_, r in silent[:1]] or signalled or own or sorted(failed))[0]
    w = seen[rank].where if rank in seen else None
    if rank in frozen:
        how = "stopped responding (its process is stopped)"
    elif error(rank):
        how = f"failed ({error(rank)})"
    elif rank in failed and failed[rank].exitcode < 0:
        how = f"was killed by {failed[rank].signal_name()}"
    elif rank in failed:
        how = f"exited with status {failed[rank].exitcode}"
    else:
        how = "died"
    if w is None:
        at = "before its first step"
    elif w["phase"] == "checkpoint":
        at = f"while saving the checkpoint of step {w['step']}"
    elif w["phase"] == "resume":
        at = f"while loading the checkpoint of step {w['step']}"
    else:
        at = f"at step {w['step']} of {steps}"
    return f"rank {rank} {how} {at}; the other ranks were stopped"
