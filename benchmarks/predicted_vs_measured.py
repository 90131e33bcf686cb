"""Predicted against measured, on this machine: calibrate it, then run the searched plan and every
hand-written layout (dp, tp, pp × microbatches) for real and compare their ranks.

    python benchmarks/predicted_vs_measured.py [--model gpt-small] [--nproc 4] [--cluster FILE]

Without --cluster it first runs `autopar calibrate --nproc N` into a temporary file. Prints the
markdown table of the README: every layout's predicted and measured step time (medians of 5 timed
steps after 2 warm-up steps, the slowest rank's), Spearman's rank correlation, and how the
searched plan measures against the fastest. Run it alone: other work on the cores skews it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._cli import run_cli


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--cluster", help="a calibrated cluster file (default: calibrate now)")
    args = ap.parse_args()
    cluster = args.cluster
    if cluster is None:
        cluster = os.path.join(tempfile.mkdtemp(), "cluster.json")
        run_cli("calibrate", "--nproc", str(args.nproc), "--out", cluster)
    result, wall, _ = run_cli("bench", args.model, "--nproc", str(args.nproc), "--cluster", cluster)
    rows = sorted(result["layouts"], key=lambda r: r["measured_step_time_s"])
    fastest = rows[0]["measured_step_time_s"]
    print(f"| layout ({args.model}, {args.nproc} ranks) | microbatches | predicted ms | measured ms | measured / fastest |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {'**searched**' if r['name'] == 'auto' else r['name']} | {r['num_microbatches']} | "
              f"{r['predicted_step_time_s'] * 1e3:.0f} | {r['measured_step_time_s'] * 1e3:.0f} | "
              f"{r['measured_step_time_s'] / fastest:.2f} |")
    print(f"\nSpearman {result['spearman']:.2f} over {len(rows)} layouts; the searched plan measures "
          f"{result['auto_vs_fastest']:.2f}× the fastest ({wall:.0f} s)")


if __name__ == "__main__":
    main()
