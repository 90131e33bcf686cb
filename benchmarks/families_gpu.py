"""The transformers families of tests/families.py on one CUDA device through `autopar.parallelize`
(NCCL, a job of one): losses against the same model trained eagerly on the same device.

No test depends on a GPU; this script is what the README's GPU row comes from. fp32 with TF32 off,
so the comparison is exact to rounding; `--steps` steps of SGD with momentum.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import autopar
from tests.families import FAMILIES
from tests.test_families import _optimizer, _setup, _single


def run(name: str, steps: int) -> dict:
    eager, _ = _single(name, steps, "cuda")
    w, batches = _setup(name, steps=steps, device="cuda")
    start = time.perf_counter()
    pm = autopar.parallelize(w.model, (1, 1), w.example_inputs, loss_fn=w.loss_fn, optimizer=_optimizer,
                             plan="1,1,1")
    got = [pm.step(inputs, target) for inputs, target in batches]
    torch.cuda.synchronize()
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, eager))
    return {"family": name, "losses": got, "eager": eager, "max_rel_diff": worst,
            "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = [run(name, args.steps) for name in FAMILIES]
    backend = dist.get_backend() if dist.is_initialized() else "none"
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "backend": backend, "rows": rows}, indent=1))
        return
    print(f"{torch.cuda.get_device_name()}, backend {backend}")
    for r in rows:
        print(f"{r['family']:12s} max rel diff {r['max_rel_diff']:.1e}  losses {[round(x, 5) for x in r['losses']]}")


if __name__ == "__main__":
    main()
