"""Predicted against measured, on this machine: calibrate it, then run the searched plan and every
hand-written layout (dp, tp, pp × microbatches, and each recomputing, in bf16 and under ZeRO-3)
of several model families for real, and compare ranks, magnitudes and where the time goes.

    python benchmarks/predicted_vs_measured.py [--models gpt-small,moe-small] [--nproc 2]
        [--calibrations 2] [--launches 3] [--ranking-nproc 4] [--cluster FILE] [--out DIR] [--resume]

Each calibration is a fresh `autopar calibrate --nproc N` into DIR (unless --cluster names one),
then per family one `autopar bench MODEL --nproc N --launches L --breakdown` (each rank on a core of
its own where the machine has enough; 2 warm-up and 5 timed steps per layout per launch, the slowest
rank's median; a layout's time the median of its launches, its spread their range over it), one
`autopar calibrate --from` that bench (half the layouts fitted, the other half held out) and one
`autopar plan --tune K`. With --ranking-nproc, each family once more on that many ranks (sharing the
cores where they outnumber them: the ranking only, Spearman), written to its own page,
docs/benchmarks/results/predicted_vs_measured-N-ranks.md (`--calibrations 0` runs only that). With
--resume, what an earlier run into the same --out finished is read back (summary.json is written
after each family). Prints markdown and writes it, with a log-log picture of predicted against
measured step time, to docs/benchmarks/results/predicted_vs_measured.md (and .png): per family and calibration the layouts
(predicted, measured, spread, ratio, and the measured breakdown of the slowest rank: forward,
backward, tensor-axis collectives, overhead, data-axis wait, pipeline, optimizer), Spearman's rank
correlation, the searched plan against the fastest measured (and whether their launches overlap:
a tie), the median absolute error of the prediction, the noise (median spread, tied pairs), and
which terms of the prediction are furthest from their measurement. Timing needs an idle machine:
it says so when the load average is above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from _page import against, picture, table, write
from _stamp import commit, stamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def summarise(result: dict) -> dict:
    """A bench's figures the issue asks for (its times already the medians of its launches)."""
    rows = result["layouts"]
    predicted = [r["predicted_step_time_s"] for r in rows]
    measured = [r["measured_step_time_s"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return {"layouts": rows, "spearman": result["spearman"], "auto_vs_fastest": result["auto_vs_fastest"],
            "auto_tied_with_fastest": result["auto_tied_with_fastest"], "noise": result["noise"],
            "pinned": result["pinned"], "median_abs_error": statistics.median(errors), "terms": term_errors(rows)}


def slowest(row: dict) -> dict:
    b = row.get("breakdown")
    return max(b["measured"], key=lambda m: m["step_s"]) if b else {}


def family_table(model: str, nproc: int, s: dict, title: str) -> str:
    """A family's layouts (fastest measured first) as a Markdown table, then its summary line."""
    rows = []
    for r in sorted(s["layouts"], key=lambda r: r["measured_step_time_s"]):
        m = slowest(r)
        parts = [m.get(k, 0.0) * 1e3 for k in ("forward_s", "backward_s", "tp_comm_s", "overhead_s", "dp_sync_s",
                                              "pipeline_s", "optimizer_s")]
        rows.append(["**searched**" if r["name"] == "auto" else r["name"], r["num_microbatches"],
                     f"{r['predicted_step_time_s'] * 1e3:.0f}", f"{r['measured_step_time_s'] * 1e3:.0f}",
                     f"{r['spread']:.1%}", f"{r['measured_step_time_s'] / r['predicted_step_time_s']:.2f}",
                     *(f"{x:.0f}" for x in parts)])
    header = [f"layout ({model}, {nproc} ranks, {title})", "mb", "predicted ms", "measured ms", "spread",
              "measured / predicted", "fwd", "bwd", "tp comm", "overhead", "dp wait", "pipeline", "optimizer"]
    terms = ", ".join(f"{t.removesuffix('_s')} {e:.0%}" for t, e in sorted(s["terms"].items(), key=lambda x: -x[1]))
    noise = s["noise"]
    return (table(header, rows, right=tuple(range(1, 13)))
            + f"\n{model}, {title}: Spearman **{s['spearman']:.2f}** over {len(s['layouts'])} layouts; the searched "
            f"plan measures **{s['auto_vs_fastest']:.2f}×** the fastest"
            + (" (their launches overlap: a tie)" if s["auto_tied_with_fastest"] and s["auto_vs_fastest"] > 1 else "")
            + f"; median |error| of the predicted step **{s['median_abs_error']:.0%}**; noise: spread "
            f"{noise['median_spread']:.1%} median, {noise['max_spread']:.1%} at most, {noise['ties']} of "
            f"{noise['pairs']} layout pairs tied"
            + (f", {noise['ordered']:.0%} of the others predicted in their measured order" if "ordered" in noise else "")
            + "; " + ("each rank on a core of its own" if s["pinned"] else "the ranks share the cores")
            + f"; error per term (mean share of the step): {terms}")


def fitted_and_tuned(s: dict, k: int) -> str:
    """`calibrate --from` the bench (half the layouts fitted, the other half held out) and
    `plan --tune K` (the K best predicted layouts run, the fastest kept), against the bench's
    fastest measured layout."""
    fit = s["fit"]
    text = (f"\n\nFit from runs (`autopar calibrate --from` the bench): median |error| of the held-out layouts "
            f"{fit['error_before']['held_out']:.0%} before, **{fit['error_after']['held_out']:.0%}** after.")
    if k and "tune" in s:
        tuned = s["tune"]["search"]["tuned"]
        kept = min((t for t in tuned if t["measured_step_time_s"]), key=lambda t: t["measured_step_time_s"])
        fastest = min(r["measured_step_time_s"] for r in s["layouts"])
        same = min(r["measured_step_time_s"] for r in s["layouts"] if r["precision"] == "fp32")  # what it searches
        # the tune's one start of the ranks against the bench's launches: the searched plan ran in
        # both, so the kept plan's time is put on the bench's scale by it (a machine's speed drifts
        # by more than the target between starts)
        searched = next((t["measured_step_time_s"] for t in tuned if t["name"] == "auto"), None)
        benched = next((r["measured_step_time_s"] for r in s["layouts"] if r["name"] == "auto"), None)
        scale = benched / searched if searched and benched else 1.0
        on_bench = kept["measured_step_time_s"] * scale
        text += (f" Tune by measuring (`autopar plan --tune {k}`): measured "
                 + ", ".join(f"{t['name']} {t['measured_step_time_s'] * 1e3:.0f} ms" if t["measured_step_time_s"]
                             else f"{t['name']} did not run" for t in tuned)
                 + f"; kept {kept['name']}, **{on_bench / fastest:.2f}×** the bench's fastest"
                 + (f" ({on_bench / same:.2f}× its fastest fp32 layout, the precision it searches)"
                    if same != fastest else "")
                 + (f" (its time × {scale:.2f}, the searched plan's in the bench over its in the tune's start; "
                    f"unscaled {kept['measured_step_time_s'] / fastest:.2f}×)" if scale != 1.0 else "") + ".")
    return text


def ranking(models: list[str], nproc: int, launches: int, out: str, resume: bool = False) -> str:
    """Each family on `nproc` ranks (sharing the cores where they outnumber them) after a calibration
    of its own: the ranking only (Spearman), beside the record's (`resume`: those already in `out`
    read back). Its own page, since it runs for hours on its own where ranks share cores."""
    started = stamp()
    cluster = os.path.join(out, f"cluster-{nproc}-ranks.json")
    if not (resume and os.path.exists(cluster)):
        run_cli("calibrate", "--nproc", str(nproc), "--out", cluster)
    rows, notes = [], []
    for model in models:
        path = os.path.join(out, f"{model}-{nproc}-ranks.json")
        if resume and os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            notes.append(f"{model}: read back, its bench written "
                         + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(os.path.getmtime(path))) + ".")
        else:
            result, wall, _ = run_cli("bench", model, "--nproc", str(nproc), "--cluster", cluster,
                                      "--launches", str(launches))
            with open(path, "w") as f:
                json.dump(result, f)
            print(f"{model} on {nproc} ranks: Spearman {result['spearman']:.2f} ({wall:.0f} s)", file=sys.stderr)
        rows.append([model, len(result["layouts"]), f"{result['spearman']:.2f}", f"{result['auto_vs_fastest']:.2f}",
                     f"{summarise(result)['median_abs_error']:.0%}",
                     f"{result['noise']['median_spread']:.1%}" if launches > 1 else "(one launch)",
                     "yes" if result["pinned"] else "no", len(result.get("refused", []))])
        notes += [f"{model}'s {r['name']} refused when built: {r['why'].split('. ')[0]}." for r in result.get("refused", [])]
    body = (f"The ranking on {nproc} ranks ({launches} launch{'es' if launches > 1 else ''} each):\n\n"
            + table(["family", "layouts", "Spearman", "searched / fastest", "median abs. error", "median spread",
                     "a core per rank", "refused"], rows, right=(1, 2, 3, 4, 5, 7)) + ("\n" + " ".join(notes) if notes else ""))
    write(f"predicted_vs_measured-{nproc}-ranks", started, body)
    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-small,moe-small")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--calibrations", type=int, default=2, help="fresh calibrations, each followed by the benches")
    ap.add_argument("--launches", type=int, default=3, help="bench --launches")
    ap.add_argument("--ranking-nproc", type=int, default=4, help="also each family on this many ranks, its "
                    "ranking only (0: not)")
    ap.add_argument("--ranking-launches", type=int, default=0, help="bench --launches of the ranking "
                    "(default: --launches)")
    ap.add_argument("--cluster", help="a calibrated cluster file (default: calibrate now, once per calibration)")
    ap.add_argument("--tune", type=int, default=4, help="also `autopar plan MODEL --tune K` (0: not)")
    ap.add_argument("--out", default=None, help="directory for the bench JSON files (default: a temporary one)")
    ap.add_argument("--resume", action="store_true", help="read back what an earlier run into --out finished "
                    "(calibrations, benches, fits, tunes, rankings) instead of running it again")
    args = ap.parse_args()
    started, load = stamp(), os.getloadavg()[0]
    if load > 1:
        print(f"warning: load average {load:.2f} before starting: other work shares the cores, timings will be off",
              file=sys.stderr)
    out = args.out or tempfile.mkdtemp(prefix="pvm-")
    os.makedirs(out, exist_ok=True)
    models = args.models.split(",")
    summary, families, sections = {}, {}, []
    try:
        run_all(args, out, models, summary, families, sections)
    except RuntimeError as exc:  # a failed run keeps what finished before it, and says what failed
        sections.append(f"**Stopped**: {str(exc).splitlines()[0]} ({str(exc).strip().splitlines()[-1]})")
        print(sections[-1], file=sys.stderr)
    print(f"(load average before: {load:.2f}; bench JSON in {out})")
    if not families:  # --calibrations 0: the ranking's own page only
        return
    against(picture("predicted_vs_measured"),
            {name: ([1e3 * r["predicted_step_time_s"] for r in s["layouts"]],
                    [1e3 * r["measured_step_time_s"] for r in s["layouts"]]) for name, s in families.items()},
            "step ms", "step time per layout, this machine", log=True)
    write("predicted_vs_measured", started, "\n\n".join(sections) + "\n\n![predicted against measured step time "
          "per layout, log-log, with y = x](results/predicted_vs_measured.png)\n")


def _finished(out: str, resume: bool) -> dict:
    """What an earlier run into `out` finished (its summary.json, by family), where `resume` asks
    for it."""
    path = os.path.join(out, "summary.json")
    if not resume or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_all(args: argparse.Namespace, out: str, models: list[str], summary: dict, families: dict,
            sections: list[str]) -> None:
    """Each calibration and its benches, fits and tunes, appending to `summary`, `families`, `sections`.
    With `--resume` what an earlier run into the same directory finished (a calibration's cluster
    file, a family's bench, fit and tune) is read back, not run again; summary.json is written after
    each family, so a run that stops can be resumed."""
    done = _finished(out, args.resume)
    for c in range(1 if args.cluster else args.calibrations):
        title = "given cluster" if args.cluster else f"calibration {c + 1}"
        cluster = args.cluster or os.path.join(out, f"cluster-{c}.json")
        if not args.cluster and not (args.resume and os.path.exists(cluster)):
            run_cli("calibrate", "--nproc", str(args.nproc), "--out", cluster)
        for model in models:
            key, path = f"{model}, {title}", os.path.join(out, f"{model}-{c}.json")
            if key in done and os.path.exists(path):
                with open(path) as f:
                    s = families[key] = {**summarise(json.load(f)), **done[key]}
                s.setdefault("measured", "by " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(os.path.getmtime(path)))
                             + " (when its bench was written)")
                print(f"{key}: read back from {path}", file=sys.stderr)
            else:
                s_started = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at commit {commit()}, load average "
                             f"{os.getloadavg()[0]:.2f} before its bench")
                result, wall, _ = run_cli("bench", model, "--nproc", str(args.nproc), "--cluster", cluster,
                                          "--launches", str(args.launches), "--breakdown", os.path.join(out, f"{model}-{c}"))
                with open(path, "w") as f:
                    json.dump(result, f)
                print(f"{key}: Spearman {result['spearman']:.2f} ({wall:.0f} s)", file=sys.stderr)
                s = families[key] = summarise(result)
                s["fit"] = run_cli("calibrate", "--from", path, "--cluster", cluster,
                                   "--out", os.path.join(out, f"{model}-{c}-fitted.json"))[0]
                if args.tune:
                    s["tune"] = run_cli("plan", model, "--mesh", f"1x{args.nproc}", "--cluster", cluster,
                                        "--tune", str(args.tune))[0]
                s["measured"] = s_started
            summary[key] = {k: v for k, v in s.items() if k != "layouts"}
            with open(os.path.join(out, "summary.json"), "w") as f:
                json.dump({**done, **summary}, f, indent=2)
            sections.append(family_table(model, args.nproc, s, title) + fitted_and_tuned(s, args.tune)
                            + f" Measured {s['measured']}.")
            print(sections[-1] + "\n")
    if args.ranking_nproc:
        print(ranking(models, args.ranking_nproc, args.ranking_launches or args.launches, out, args.resume))


if __name__ == "__main__":
    main()
