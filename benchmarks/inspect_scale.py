"""Capture cost at scale: wall time and peak memory of `autopar inspect MODEL --batch 8 --json`.

Each model runs in a fresh process (startup and import included, as a user sees it); prints a
Markdown table and writes it to docs/benchmarks/results/inspect_scale.md.

    python benchmarks/inspect_scale.py [MODEL ...]
"""

from __future__ import annotations

import sys

from _cli import run_cli
from _page import table, write
from _stamp import stamp
from rich.progress import track

DEFAULT = ["gpt-1.3b", "gpt-39b", "gpt3-175b", "megatron-1t", "moe-70b", "wresnet-13b"]


def main() -> None:
    models = sys.argv[1:] or DEFAULT
    started, rows = stamp(), []
    for model in track(models, description="inspect", transient=True):
        r, wall, rss = run_cli("inspect", model, "--batch", "8")
        rows.append([model, f"{r['num_params'] / 1e9:.1f} B", r["num_nodes"], f"{r['flops_forward']:.3g}",
                     f"{r['capture_time_s']:.1f}", f"{wall:.1f}", f"{rss / 2**20:.0f} MiB"])
    body = table(["model", "parameters", "graph nodes", "forward FLOPs (batch 8)", "capture s", "wall s", "peak RSS"], rows)
    print(body)
    write("inspect_scale", started, body)


if __name__ == "__main__":
    main()
