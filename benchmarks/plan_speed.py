"""Planner speed: `autopar plan MODEL --cluster a100-dgx --mesh 1x8 --stages 1 --batch 16`, whole command.

Each run is a fresh process (Python's start and `import torch` included). The intra-op pass
solves one ILP per logical mesh (8x1, 4x2, 2x4, 1x8); repeated layers share variables, so the
ILP's size does not grow with the layer count. Prints a Markdown table for the README.

    python benchmarks/plan_speed.py [MODEL ...]
"""

from __future__ import annotations

import sys

from _cli import run_cli
from rich.progress import track

DEFAULT = ["gpt-350m", "gpt-1.3b", "gpt-2.6b", "gpt-6.7b", "gpt-15b"]  # gpt-39b does not fit on 8 A100s


def main() -> None:
    models = sys.argv[1:] or DEFAULT
    print("| model | layers | ops placed | ILP groups | ILP variables | solver s (4 meshes) | capture s | "
          "planning s | wall s | chosen dp × tp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in track(models, description="plan", transient=True):
        plan, wall, _ = run_cli("plan", model, "--cluster", "a100-dgx", "--mesh", "1x8", "--stages", "1",
                                "--batch", "16")
        stage = plan["stages"][0]
        solver = stage["solver"]
        layers = sum(1 for p in stage["params"] if p.endswith("mlp.fc1.weight"))
        solve_s = sum(c.get("solve_time_s", 0) for c in plan["candidates"])
        dp, tp = stage["logical_mesh"]
        print(f"| {model} | {layers} | {solver['anchors']} | {solver['ilp_nodes']} | {solver['variables']} | "
              f"{solve_s:.2f} | {plan['capture_time_s']:.1f} | {plan['planning_time_s']:.1f} | {wall:.1f} | "
              f"{dp} × {tp} |")


if __name__ == "__main__":
    main()
