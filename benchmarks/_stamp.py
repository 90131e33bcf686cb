"""What a generated result is stamped with: date, commit, machine, load, library versions."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess


def commit() -> str:
    """The checkout's short commit, `+` when its code has uncommitted changes (results and docs aside)."""
    if os.environ.get("AUTOPAR_COMMIT"):  # a copy whose git is not the code's (a GPU machine's): the caller says
        return os.environ["AUTOPAR_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks/results", ":!docs"],  # a run's own results do not make the code another
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def machine() -> str:
    """CPU model and cores (`nproc`), and the GPU where there is one."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    out = f"{cpu}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"
    import torch

    if torch.cuda.is_available():
        out += f", {torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    return out


def stamp() -> dict:
    """Taken when a benchmark starts: the load average then is the one that matters."""
    import torch

    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
            "machine": machine(), "load": round(os.getloadavg()[0], 2), "torch": torch.__version__, "transformers": hf}


def line(s: dict) -> str:
    return (f"{s['date']}, commit {s['commit']}, {s['machine']}, load average {s['load']}, torch {s['torch']}"
            + (f", transformers {s['transformers']}" if s.get("transformers") else ""))
