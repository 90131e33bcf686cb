"""Run one torchrun job many times and count the runs that crash natively (a signal, glibc's
heap checks, `terminate called ...`): the check behind issue 15's intermittent exit crash.

    python benchmarks/repeat_jobs.py --runs 100 --nproc 2 -- examples/train_gpt.py --plan 1,2,1 --steps 3

`MALLOC_CHECK_=3` is set so that heap corruption aborts at once instead of sometimes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

from _page import table, write
from _stamp import stamp

SIGNS = ("terminate called", "malloc(", "free(", "double free", "corrupted", "Segmentation fault", "SIGSEGV",
         "SIGABRT", "core dumped")


def run_once(nproc: int, script: list[str], timeout: float) -> tuple[int, str]:
    env = {**os.environ, "MALLOC_CHECK_": "3", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *script]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    return done.returncode, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--parallel", type=int, default=1, help="jobs at once (a machine with cores to spare)")
    parser.add_argument("--name", help="also write the page fragment repeat_jobs-NAME (docs/benchmarks/results)")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    started = stamp()
    outcomes: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    start = time.perf_counter()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(args.parallel) as pool:
        results = pool.map(lambda _: run_once(args.nproc, script, args.timeout), range(args.runs))
    for i, (code, text) in enumerate(results):
        sign = next((s for s in SIGNS if s in text), None)
        kind = "ok" if code == 0 and sign is None else f"exit {code}" + (f", {sign}" if sign else "")
        outcomes[kind] += 1
        if kind != "ok":
            examples.setdefault(kind, text[-12000:])
        print(f"run {i + 1}/{args.runs}: {kind}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    print(json.dumps({"runs": args.runs, "outcomes": dict(outcomes), "wall_s": round(wall, 1),
                      "examples": examples}, indent=1))
    if args.name:
        body = table(["outcome", "runs"], [[k, n] for k, n in outcomes.most_common()], right=(1,))
        write(f"repeat_jobs-{args.name}", started, f"`{' '.join(script)}` on {args.nproc} ranks, {args.runs} runs, "
              f"{args.parallel} at a time ({wall:.0f} s):\n\n{body}")


if __name__ == "__main__":
    main()
