"""Auto plan against every valid hand-written 3D layout, predicted, for Alpa's GPT and MoE
suites on `v100-p3` at the GPU counts of the Alpa paper (global batch 1024). Prints a Markdown
table next to the per-GPU TFLOP/s measured in the Alpa paper (REFERENCES.md; for MoE the
baseline column is DeepSpeed's), and for MoE the predicted speedup of the auto plan over the
DeepSpeed-style layout next to the measured Alpa / DeepSpeed ratio (3.5× on 16 GPUs, 10.2× on 32).
"found by" says whether the stage DP found the auto plan or the floor did (a hand-written layout
priced in the search's own space that beat the DP's plan: `autopar.planner.auto`). Writes the table to docs/benchmarks/results/compare_suites.md.

    python benchmarks/compare_suites.py [MODEL ...]
"""

from __future__ import annotations

import sys

from _cli import memory_choices, run_cli
from _page import table, write
from _stamp import stamp
from rich.progress import track

SUITE = {  # model: (mesh, Alpa measured TFLOP/s per GPU, baseline measured: Megatron-LM for GPT, DeepSpeed for MoE)
    "gpt-350m": ("1x1", 45.1, 47.5),
    "gpt-760m": ("1x2", 57.9, 55.5),
    "gpt-1.3b": ("1x4", 58.2, 55.9),
    "gpt-2.6b": ("1x8", 61.6, 50.4),
    "gpt-6.7b": ("2x8", 60.0, 56.6),
    "gpt-15b": ("4x8", 59.9, 58.2),
    "gpt-39b": ("8x8", 57.0, 57.8),
    "moe-380m": ("1x1", 45.5, 34.2),
    "moe-690m": ("1x2", 43.0, 33.1),
    "moe-1.3b": ("1x4", 39.9, 34.7),
    "moe-2.4b": ("1x8", 45.8, 40.0),
    "moe-10b": ("2x8", 45.4, 12.9),
    "moe-27b": ("4x8", 38.8, 3.8),
    "moe-70b": ("8x8", 36.6, "OOM"),
}


HEADER = ["model", "GPUs", "auto: stages × submesh, microbatches, schedule", "found by", "auto TFLOP/s/GPU",
          "auto, 1F1B only TFLOP/s/GPU", "best hand-written (fits)", "its TFLOP/s/GPU", "auto ≤ best",
          "auto / deepspeed-moe predicted", "Alpa measured", "Megatron-LM / DeepSpeed measured",
          "Alpa / DeepSpeed measured", "wall s"]


def main() -> None:
    models = sys.argv[1:] or list(SUITE)
    started, rows = stamp(), []
    for model in track(models, description="compare", transient=True):
        rows.append(_row(model))
    body = table(HEADER, rows)
    print(body)
    write("compare_suites", started, body)


def _row(model: str) -> list:
    mesh, alpa, baseline = SUITE[model]
    measured = f"{alpa / baseline:.1f}×" if model.startswith("moe") and isinstance(baseline, float) else "–"
    hosts, per_host = (int(x) for x in mesh.split("x"))
    try:
        r, wall, _ = run_cli("compare", model, "--cluster", "v100-p3", "--mesh", mesh, "--batch", "1024")
    except RuntimeError as exc:  # the model fits on no layout: say so, with the planner's own words
        why = str(exc).split("error:")[-1].split("MAXRSS")[0].strip()
        return [model, hosts * per_host, why, "–", "–", "–", "–", "–", "–", "–", alpa, baseline, measured, "–"]
    before, _, _ = run_cli("plan", model, "--cluster", "v100-p3", "--mesh", mesh, "--batch", "1024",
                           "--schedule", "1f1b")  # the search space without the other schedules
    fitting = [m for m in r["manual"] if m["fits"]]
    best = min(fitting, key=lambda m: m["step_time_s"]) if fitting else None
    auto = r["auto"]
    ok = best is None or auto["step_time_s"] <= best["step_time_s"] * (1 + 1e-9)
    ds = next((m for m in r["manual"] if m["name"] == "deepspeed-moe"), None)
    speedup = "–" if ds is None else (f"{ds['step_time_s'] / auto['step_time_s']:.2f}×" if ds["fits"]
                                      else "deepspeed-moe does not fit")
    chose = (f"{len(auto['stages'])} stage(s), {auto['num_microbatches']}, {auto['schedule']}"
             + (f" v{auto['virtual']}" if auto["virtual"] > 1 else "") + memory_choices(auto["stages"]))
    return [model, hosts * per_host, chose, auto["found_by"], f"{auto['tflops_per_device']:.1f}",
            f"{before['estimate']['tflops_per_device']:.1f}", best["name"] if best else "none fits",
            f"{best['tflops_per_device']:.1f}" if best else "–", "yes" if ok else "NO", speedup, alpa, baseline,
            measured, f"{wall:.0f}"]


if __name__ == "__main__":
    main()
