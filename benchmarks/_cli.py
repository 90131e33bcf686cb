"""Run one `autopar` command in a fresh process, as a user would: wall time, peak memory, its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import time

_CHILD = (  # what the `autopar` entry point (autopar.cli:run) does, plus the peak RSS on stderr
    "import os, resource, sys; from autopar.cli import main; rc = main(sys.argv[1:]); "
    "sys.stdout.flush(); sys.stderr.write('MAXRSS %d' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); "
    "sys.stderr.flush(); os._exit(rc)"
)


def run_cli(*args: str) -> tuple[dict, float, int]:
    """(the command's JSON, wall seconds including Python's start and imports, peak RSS bytes)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"autopar {' '.join(args)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout), wall, int(proc.stderr.rsplit("MAXRSS", 1)[1]) * 1024


def memory_choices(stages: list[dict]) -> str:
    """The stages' ZeRO levels and offloading, as a table cell says them (", ZeRO-2 offloaded ×1")."""
    counts: dict[str, int] = {}
    for s in stages:
        if s.get("zero"):
            key = f"ZeRO-{s['zero']}" + (" offloaded" if s.get("offload") else "")
            counts[key] = counts.get(key, 0) + 1
    return "".join(f", {key} ×{n}" for key, n in sorted(counts.items()))
