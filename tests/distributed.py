"""Run a function on N gloo ranks in fresh processes and collect what each rank returns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world: int, store: str, out: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
        dist.barrier()  # no rank tears down while another still reads from it (gloo aborts then)
    finally:
        dist.destroy_process_group()
    # the result is saved: skip interpreter teardown, where a gloo/FSDP thread still joinable at
    # exit sometimes aborts the process ("terminate called without an active exception")
    os._exit(0)


def run_ranks(fn: Callable, world: int, tmp: Path, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` processes (fn must be importable: a module-level function)."""
    out = tmp / "ranks"
    out.mkdir(exist_ok=True)
    mp.spawn(_entry, args=(fn, world, str(tmp / "store"), str(out), args), nprocs=world, join=True)
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(world)]
