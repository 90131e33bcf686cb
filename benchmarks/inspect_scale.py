"""Capture cost at scale: wall time and peak memory of `autopar inspect MODEL --batch 8 --json`.

Each model runs in a fresh process (startup and import included, as a user sees it); prints a
Markdown table for the README.

    python benchmarks/inspect_scale.py [MODEL ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

DEFAULT = ["gpt-1.3b", "gpt-39b", "gpt3-175b", "megatron-1t", "moe-70b", "wresnet-13b"]


_CHILD = (
    "import resource, sys; from autopar.cli import main; rc = main(sys.argv[1:]); "
    "sys.stderr.write('MAXRSS %d' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
)


def measure(model: str, batch: int = 8) -> dict:
    """Run `autopar inspect` in a fresh process; its own peak RSS is reported on its last stderr line."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, "inspect", model, "--batch", str(batch), "--json"],
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    report = json.loads(proc.stdout)
    peak = int(proc.stderr.rsplit("MAXRSS", 1)[1]) * 1024
    return {"model": model, "wall_s": wall, "peak_rss_bytes": peak, **{k: report[k] for k in
            ("num_params", "num_nodes", "flops_forward", "capture_time_s")}}


def main() -> None:
    from rich.progress import track

    models = sys.argv[1:] or DEFAULT
    rows = [measure(m) for m in track(models, description="inspect", transient=True)]
    print("| model | parameters | graph nodes | forward FLOPs (batch 8) | capture s | wall s | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['num_params'] / 1e9:.1f} B | {r['num_nodes']} | {r['flops_forward']:.3g} | "
              f"{r['capture_time_s']:.1f} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
