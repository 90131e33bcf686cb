"""Predicted against measured, on this machine: calibrate it, then run the searched plan and every
hand-written layout (dp, tp, pp × microbatches, and each recomputing, in bf16 and under ZeRO-3)
of several model families for real, and compare ranks, magnitudes and where the time goes.

    python benchmarks/predicted_vs_measured.py [--models gpt-small,moe-small,wresnet-small]
        [--nproc 4] [--repeats 3] [--cluster FILE] [--out DIR]

Without --cluster it first runs `autopar calibrate --nproc N` into DIR. Each repetition is one
`autopar bench MODEL --nproc N --breakdown` (2 warm-up and 5 timed steps per layout, the slowest
rank's median); a layout's measured time is the median over repetitions. Prints markdown and
writes it, with a log-log picture of predicted against measured step time, to
docs/benchmarks/results/predicted_vs_measured.md (and .png): per family the layouts (predicted,
measured, ratio, and the measured breakdown of the slowest rank: forward, backward, tensor-axis
collectives, overhead, data-axis wait, pipeline, optimizer), Spearman's rank correlation, the
searched plan against the fastest measured, the median absolute error of the prediction, and which
terms of the prediction are furthest from their measurement. Timing needs an idle machine: it says
so when the load average is above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from _page import against, picture, table, write
from _stamp import stamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.bench import spearman
from benchmarks._cli import run_cli

TERMS = ("forward_s", "backward_s", "dp_sync_s", "pipeline_s", "optimizer_s", "other_s")


def term_errors(layouts: list[dict]) -> dict[str, float]:
    """Per term, the mean over layouts of |measured − predicted| as a share of the measured step
    (measured: the mean over the ranks of each stage; predicted: that stage's)."""
    errors = {t: [] for t in TERMS}
    for row in layouts:
        b = row.get("breakdown")
        if not b:
            continue
        for k, predicted in enumerate(b["predicted"]):
            ranks = [m for m, s in zip(b["measured"], b["stage_of"]) if s == k]
            step = statistics.mean(m["step_s"] for m in ranks)
            for t in TERMS:
                measured = statistics.mean(m[t] for m in ranks)
                errors[t].append(abs(measured - predicted[t]) / step)
    return {t: statistics.mean(v) for t, v in errors.items() if v}


def summarise(runs: list[dict]) -> dict:
    """Medians over repetitions per layout, and the figures the issue asks for."""
    names = [r["name"] for r in runs[0]["layouts"]]
    rows = []
    for i, name in enumerate(names):
        same = [run["layouts"][i] for run in runs]
        measured = statistics.median(r["measured_step_time_s"] for r in same)
        rows.append({**same[0], "measured_step_time_s": measured,
                     "measured_runs_s": [r["measured_step_time_s"] for r in same]})
    predicted = [r["predicted_step_time_s"] for r in rows]
    measured = [r["measured_step_time_s"] for r in rows]
    fastest = min(measured)
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return {"layouts": rows, "spearman": spearman(predicted, measured), "auto_vs_fastest": measured[0] / fastest,
            "median_abs_error": statistics.median(errors), "terms": term_errors(rows)}


def slowest(row: dict) -> dict:
    b = row.get("breakdown")
    return max(b["measured"], key=lambda m: m["step_s"]) if b else {}


def family_table(model: str, nproc: int, s: dict) -> str:
    """A family's layouts (fastest measured first) as a Markdown table, then its summary line."""
    rows = []
    for r in sorted(s["layouts"], key=lambda r: r["measured_step_time_s"]):
        m = slowest(r)
        parts = [m.get(k, 0.0) * 1e3 for k in ("forward_s", "backward_s", "tp_comm_s", "overhead_s", "dp_sync_s",
                                              "pipeline_s", "optimizer_s")]
        rows.append(["**searched**" if r["name"] == "auto" else r["name"], r["num_microbatches"],
                     f"{r['predicted_step_time_s'] * 1e3:.0f}", f"{r['measured_step_time_s'] * 1e3:.0f}",
                     f"{r['measured_step_time_s'] / r['predicted_step_time_s']:.2f}", *(f"{x:.0f}" for x in parts)])
    header = [f"layout ({model}, {nproc} ranks)", "mb", "predicted ms", "measured ms", "measured / predicted", "fwd",
              "bwd", "tp comm", "overhead", "dp wait", "pipeline", "optimizer"]
    terms = ", ".join(f"{t.removesuffix('_s')} {e:.0%}" for t, e in sorted(s["terms"].items(), key=lambda x: -x[1]))
    return (table(header, rows, right=tuple(range(1, 12)))
            + f"\n{model}: Spearman **{s['spearman']:.2f}** over {len(s['layouts'])} layouts; the searched plan "
            f"measures **{s['auto_vs_fastest']:.2f}×** the fastest; median |error| of the predicted step "
            f"**{s['median_abs_error']:.0%}**; error per term (mean share of the step): {terms}")


def fitted_and_tuned(s: dict, k: int) -> str:
    """`calibrate --from` on each repetition's bench (half the layouts fitted, the other half held
    out) and `plan --tune K` (the K best predicted layouts run, the fastest kept), against the
    bench's fastest measured layout."""
    fits = s["fits"]
    before = [f["error_before"]["held_out"] for f in fits]
    after = [f["error_after"]["held_out"] for f in fits]
    text = (f"\n\nFit from runs (`autopar calibrate --from` each repetition's bench): median |error| of the held-out "
            f"layouts {'/'.join(f'{b:.0%}' for b in before)} before, **{'/'.join(f'{a:.0%}' for a in after)}** "
            "after.")
    if k and "tune" in s:
        plan = s["tune"]
        tuned = plan["search"]["tuned"]
        kept = min((t for t in tuned if t["measured_step_time_s"]), key=lambda t: t["measured_step_time_s"])
        fastest = min(r["measured_step_time_s"] for r in s["layouts"])
        text += (f" Tune by measuring (`autopar plan --tune {k}`): measured "
                 + ", ".join(f"{t['name']} {t['measured_step_time_s'] * 1e3:.0f} ms" if t["measured_step_time_s"]
                             else f"{t['name']} did not run" for t in tuned)
                 + f"; kept {kept['name']}, **{kept['measured_step_time_s'] / fastest:.2f}×** the bench's fastest.")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-small,moe-small,wresnet-small")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", help="a calibrated cluster file (default: calibrate now)")
    ap.add_argument("--tune", type=int, default=4, help="also `autopar plan MODEL --tune K` (0: not)")
    ap.add_argument("--out", default=None, help="directory for the bench JSON files (default: a temporary one)")
    args = ap.parse_args()
    started, load = stamp(), os.getloadavg()[0]
    if load > 1:
        print(f"warning: load average {load:.2f} before starting: other work shares the cores, timings will be off",
              file=sys.stderr)
    out = args.out or tempfile.mkdtemp(prefix="pvm-")
    os.makedirs(out, exist_ok=True)
    cluster = args.cluster
    if cluster is None:
        cluster = os.path.join(out, "cluster.json")
        run_cli("calibrate", "--nproc", str(args.nproc), "--out", cluster)
    summary, families, sections = {}, {}, []
    for model in args.models.split(","):
        runs = []
        for k in range(args.repeats):
            result, wall, _ = run_cli("bench", model, "--nproc", str(args.nproc), "--cluster", cluster,
                                      "--breakdown", os.path.join(out, f"{model}-{k}"))
            with open(os.path.join(out, f"{model}-{k}.json"), "w") as f:
                json.dump(result, f)
            runs.append(result)
            print(f"{model} run {k + 1}/{args.repeats}: Spearman {result['spearman']:.2f} ({wall:.0f} s)",
                  file=sys.stderr)
        s = families[model] = summarise(runs)
        s["fits"] = [run_cli("calibrate", "--from", os.path.join(out, f"{model}-{k}.json"), "--cluster", cluster,
                             "--out", os.path.join(out, f"{model}-{k}-fitted.json"))[0] for k in range(args.repeats)]
        if args.tune:
            s["tune"] = run_cli("plan", model, "--mesh", f"1x{args.nproc}", "--cluster", cluster,
                                "--tune", str(args.tune))[0]
        summary[model] = {k: v for k, v in s.items() if k != "layouts"}
        sections.append(family_table(model, args.nproc, s) + fitted_and_tuned(s, args.tune))
        print(sections[-1] + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"(load average before: {load:.2f}; bench JSON in {out})")
    against(picture("predicted_vs_measured"),
            {model: ([1e3 * r["predicted_step_time_s"] for r in s["layouts"]],
                     [1e3 * r["measured_step_time_s"] for r in s["layouts"]]) for model, s in families.items()},
            "step ms", "step time per layout, this machine", log=True)
    write("predicted_vs_measured", started, "\n\n".join(sections) + "\n\n![predicted against measured step time "
          "per layout, log-log, with y = x](results/predicted_vs_measured.png)\n")


if __name__ == "__main__":
    main()
