"""Run functions on N gloo ranks in fresh processes and collect what each rank returns.

Starting N processes that import torch and transformers costs seconds on two cores, so a family
of parametrized cases can share one start (`shared_ranks`): the first case asked for runs every
case of its family, one after another, in the same processes and process group; the others read
the cached results. A case that raises fails only its own test.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.runtime.backend import same_hash_order

_CACHE: dict[tuple, list[list[tuple[bool, Any]]]] = {}


def _entry(rank: int, jobs: list[tuple[Callable, tuple]], world: int, store: str, out: str) -> None:
    # one thread per rank: N ranks with a thread per core each would fight over the 2 cores
    torch.set_num_threads(1)
    tempfile.tempdir = os.path.dirname(out)  # a case's temporary files go where pytest cleans up
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results: list[tuple[bool, Any]] = []
    for fn, args in jobs:
        torch.manual_seed(0)
        try:
            results.append((True, fn(rank, world, *args)))
        except Exception:  # noqa: BLE001 - reported by the case's own test
            # the other ranks may still wait in this case's collectives: running the next case would
            # pair theirs with ours, so this rank stops here (the spawn then ends the others)
            results.append((False, traceback.format_exc()))
            torch.save(results, os.path.join(out, f"{rank}.pt"))
            os._exit(1)
        torch.save(results, os.path.join(out, f"{rank}.pt"))  # kept if another rank's failure ends this one
    try:
        dist.barrier()  # no rank tears down while another still reads from it (gloo aborts then)
    finally:
        dist.destroy_process_group()
    # the results are saved: skip interpreter teardown, where a gloo/FSDP thread still joinable at
    # exit sometimes aborts the process ("terminate called without an active exception")
    os._exit(0)


def _spawn(jobs: list[tuple[Callable, tuple]], world: int, tmp: Path) -> list[list[tuple[bool, Any]]]:
    """Per job, per rank: (ok, result or traceback)."""
    out = tmp / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    same_hash_order()  # every rank captures a model that iterates a set as one graph
    try:
        mp.spawn(_entry, args=(jobs, world, str(tmp / "store"), str(out)), nprocs=world, join=True)
    except mp.ProcessExitedException as exc:
        if exc.signal_name:  # died without a Python error: say so for every case
            return [[(False, f"rank {exc.error_index} died: {exc}")] * world for _ in jobs]
        # else a case failed: its rank saved what it had, with the traceback
    per_rank = [torch.load(out / f"{r}.pt", weights_only=False) if (out / f"{r}.pt").exists() else []
                for r in range(world)]
    missing = (False, "not run: an earlier case failed in these ranks")
    return [[per_rank[r][j] if j < len(per_rank[r]) else missing for r in range(world)] for j in range(len(jobs))]


def _unwrap(results: list[tuple[bool, Any]]) -> list[Any]:
    failed = [value for ok, value in results if not ok]
    if failed:
        pytest.fail(failed[0], pytrace=False)
    return [value for _, value in results]


def run_ranks(fn: Callable, world: int, tmp: Path, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` processes (fn must be importable: a module-level function)."""
    return _unwrap(_spawn([(fn, args)], world, tmp)[0])


def shared_ranks(fn: Callable, world: int, cases: list[tuple], case: tuple, tmp: Path) -> list[Any]:
    """fn(rank, world, *case) per rank, with every case of `cases` run in the same `world`
    processes the first time one of them is asked for."""
    key = (fn.__module__, fn.__qualname__, world, tuple(cases))
    if key not in _CACHE:
        _CACHE[key] = _spawn([(fn, c) for c in cases], world, tmp)
    return _unwrap(_CACHE[key][cases.index(case)])
