"""Run functions on N gloo ranks in fresh processes and collect what each rank returns.

Starting N processes that import torch and transformers costs seconds on two cores, so the ranks
are started once per world size and kept (`_Ranks`), and a family of parametrized cases shares one
process group (`shared_ranks`): the first case asked for runs every case of its family, one after
another, in the same processes and process group; the others read the cached results. A case that
raises fails only its own test (and ends the ranks: the next case list starts new ones).

Ranks that have worked a while are replaced at the next case list (`FRESH_AFTER_S`): the same
12 pipeline-schedule cases ran 1.32x slower in every phase (export, lowering, steps) on 4 ranks that
had first run test_parallelize's cases (about 300 s of work) than on 4 new ones (196 against 148 s
of rank 0's time, 2026-11-29), more than a 4-rank start costs.
"""

from __future__ import annotations

import atexit
import gc
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from multiprocessing import connection
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.runtime.backend import same_hash_order

_CACHE: dict[tuple, list[list[tuple[bool, Any]]]] = {}


def _serve(rank: int, world: int, pipe: Any) -> None:
    """A rank of `_Ranks`: for each case list it is sent, join a new process group, run the cases,
    save what each returned, leave the group, say so; until the pipe closes."""
    # one thread per rank: N ranks with a thread per core each would fight over the 2 cores
    torch.set_num_threads(1)
    while True:
        try:
            jobs, store, out = pipe.recv()
        except EOFError:  # the session is over
            os._exit(0)
        tempfile.tempdir = os.path.dirname(out)  # a case's temporary files go where pytest cleans up
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        results: list[tuple[bool, Any]] = []
        for fn, args in jobs:
            torch.manual_seed(0)
            began = time.perf_counter()
            profile = _profiler(rank)
            try:
                results.append((True, fn(rank, world, *args)))
                if profile is not None:  # one file per case, numbered in the order they ran
                    profile.disable()
                    folder = os.environ["AUTOPAR_TEST_PROFILE"]
                    profile.dump_stats(os.path.join(folder, f"{len(os.listdir(folder)):04d}-{fn.__qualname__}-{world}.prof"))
                if rank == 0 and os.environ.get("AUTOPAR_TEST_TIMES"):
                    with open(os.environ["AUTOPAR_TEST_TIMES"], "a") as log:
                        log.write(f"{time.perf_counter() - began:.2f}\t{world}\t{fn.__module__}.{fn.__qualname__}\t{args!r:.120}\n")
            except Exception:  # noqa: BLE001 - reported by the case's own test
                # the other ranks may still wait in this case's collectives: running the next case would
                # pair theirs with ours, so this rank ends here (and `_Ranks` ends the others)
                results.append((False, traceback.format_exc()))
                torch.save(results, os.path.join(out, f"{rank}.pt"))
                os._exit(1)
            torch.save(results, os.path.join(out, f"{rank}.pt"))  # kept if another rank's failure ends this one
        try:
            dist.barrier()  # no rank tears down while another still reads from it (gloo aborts then)
        finally:
            dist.destroy_process_group()
        _forget_meshes()
        gc.collect()
        pipe.send(None)


def _profiler(rank: int) -> Any:
    """With AUTOPAR_TEST_PROFILE=DIR, rank 0 profiles each case (cProfile) into DIR: where a case's
    time goes inside the ranks, which pytest's own profiling never sees."""
    if rank != 0 or not os.environ.get("AUTOPAR_TEST_PROFILE"):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def _forget_meshes() -> None:
    """Empty DTensor's caches once a case list's groups are gone: they key on meshes by value and
    keep the mesh objects, so the next list's equal mesh would be handed one whose groups no longer
    exist ("could not resolve the process group registered under the name ...")."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # torch's own way, the Python and the C++ fast path's caches
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


# What every rank imports, imported once by the server the ranks are forked from (`forkserver`):
# a spawned rank imported torch, autopar and transformers anew, 10 s for 2 ranks and 23 s for 4 on
# 2 cores (2026-11-29), paid again each time ranks are replaced. The server imports no more than
# modules (no thread, no process group), so forking it is safe.
PRELOAD = ["pytest", "tests.distributed", "autopar.api", "tests.families", "transformers.modeling_utils",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Ranks:
    """`world` rank processes kept through the session (replaced after `FRESH_AFTER_S` of cases),
    forked from a server that has imported what they need (`PRELOAD`).
    Each case list gets a process group of its own (`_serve`); a rank that dies or fails ends them
    all (the others may wait on it in a collective), and the next case list starts new ones."""

    def __init__(self, world: int) -> None:
        ctx = _context()
        self.pipes, self.procs = [], []
        self.busy = 0.0  # seconds spent running case lists
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.pipes.append(ours)
            self.procs.append(proc)

    def run(self, jobs: list[tuple[Callable, tuple]], store: str, out: str) -> str | None:
        """Run the case list on every rank: None when every rank finished it, else why not (the
        ranks are ended then)."""
        began = time.perf_counter()
        try:
            return self._run(jobs, store, out)
        finally:
            self.busy += time.perf_counter() - began

    def _run(self, jobs: list[tuple[Callable, tuple]], store: str, out: str) -> str | None:
        for pipe in self.pipes:
            pipe.send((jobs, store, out))
        pending = set(range(len(self.pipes)))
        while pending:
            connection.wait([*(self.pipes[r] for r in pending), *(p.sentinel for p in self.procs)])
            for r in list(pending):
                try:
                    if self.pipes[r].poll():
                        self.pipes[r].recv()
                        pending.discard(r)
                except EOFError:  # it ended (its exit code follows)
                    self.procs[r].join()
            ended = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
            if ended:
                self.close()
                rank, code = ended[0]
                return f"rank {rank} died: signal {-code}" if code < 0 else f"rank {rank} failed"
        return None

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        for pipe in self.pipes:
            pipe.close()


_RANKS: dict[int, _Ranks] = {}
FRESH_AFTER_S = 200.0  # seconds of cases after which a world's ranks are replaced (see the module's docstring)


def _close_all() -> None:
    for ranks in _RANKS.values():
        ranks.close()


atexit.register(_close_all)


def _spawn(jobs: list[tuple[Callable, tuple]], world: int, tmp: Path) -> list[list[tuple[bool, Any]]]:
    """Per job, per rank: (ok, result or traceback)."""
    out = tmp / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    same_hash_order()  # every rank captures a model that iterates a set as one graph
    if world in _RANKS and _RANKS[world].busy >= FRESH_AFTER_S:
        _RANKS.pop(world).close()
    if world not in _RANKS:
        _RANKS[world] = _Ranks(world)
    why = _RANKS[world].run(jobs, str(tmp / "store"), str(out))
    if why is not None:
        del _RANKS[world]
        if "died" in why:  # without a Python error: say so for every case
            return [[(False, why)] * world for _ in jobs]
        # else a case failed: its rank saved what it had, with the traceback
    per_rank = [_saved(out / f"{r}.pt") for r in range(world)]
    missing = (False, "not run: an earlier case failed in these ranks")
    return [[per_rank[r][j] if j < len(per_rank[r]) else missing for r in range(world)] for j in range(len(jobs))]


def _saved(path: Path) -> list[tuple[bool, Any]]:
    """What a rank saved of its cases: none where it saved nothing, or was ended while saving."""
    try:
        return torch.load(path, weights_only=False)
    except (FileNotFoundError, EOFError, RuntimeError):
        return []


def _unwrap(results: list[tuple[bool, Any]]) -> list[Any]:
    failed = [value for ok, value in results if not ok]
    if failed:  # the rank that raised, before those ended because it did
        pytest.fail(min(failed, key=lambda why: why.startswith("not run")), pytrace=False)
    return [value for _, value in results]


def on_rank0(make: Callable[[], Any]) -> Any:
    """`make()` run on rank 0 and its result sent to every rank, as `parallelize` does with the plans
    it makes (planning on every rank of a job sharing 2 cores costs the job that many times over)."""
    if not dist.is_initialized():
        return make()
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_ranks(fn: Callable, world: int, tmp: Path, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` processes (fn must be importable: a module-level function)."""
    return _unwrap(_spawn([(fn, args)], world, tmp)[0])


SWEEP = pytest.mark.sweep  # a case of a matrix beyond CI's slice: `pytest -m sweep tests` runs them


def tiered(cases: list[tuple], sweep: Collection[tuple]) -> list[Any]:
    """`cases` as parametrize values, those in `sweep` marked `SWEEP` (deselected unless asked for)."""
    return [pytest.param(*c, marks=SWEEP) if c in sweep else c for c in cases]


def shared_ranks(fn: Callable, world: int, cases: list[tuple], case: tuple, tmp: Path,
                 sweep: Collection[tuple] = ()) -> list[Any]:
    """fn(rank, world, *case) per rank, with every case of `cases` run in the same `world`
    processes the first time one of them is asked for; the cases in `sweep` (`tiered`) share a
    start of their own, so CI's slice never runs them."""
    cases = [c for c in cases if (c in sweep) == (case in sweep)]
    key = (fn.__module__, fn.__qualname__, world, tuple(cases))
    if key not in _CACHE:
        _CACHE[key] = _spawn([(fn, c) for c in cases], world, tmp)
    return _unwrap(_CACHE[key][cases.index(case)])
