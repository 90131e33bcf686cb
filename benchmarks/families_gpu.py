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

import autopar
from tests.families import FAMILIES, workload


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _to(inputs, device):
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return tuple(x.to(device) for x in inputs)


def _batches(w, steps, device):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        inputs, target = w.make_batch(w.batch, g)
        out.append((_to(inputs, device), target.to(device)))
    return out


def run(name: str, steps: int) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(0)
    w = workload(name)
    w.model.to(device)
    eager = [p.detach().clone() for p in w.model.parameters()]
    batches = _batches(w, steps, device)
    opt = _optimizer(list(w.model.parameters()))
    ref = []
    for inputs, target in batches:
        opt.zero_grad()
        out = w.model(**inputs) if isinstance(inputs, dict) else w.model(*inputs)
        loss = w.loss_fn(autopar.first_tensor(out), target)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    with torch.no_grad():  # back to the initial weights for the parallelized run
        for p, p0 in zip(w.model.parameters(), eager):
            p.copy_(p0)
    example = _to(w.example_inputs, device)
    start = time.perf_counter()
    pm = autopar.parallelize(w.model, (1, 1), example, loss_fn=w.loss_fn, optimizer=_optimizer, plan="1,1,1")
    got = [pm.step(inputs, target) for inputs, target in batches]
    torch.cuda.synchronize()
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    return {"family": name, "losses": got, "eager": ref, "max_rel_diff": worst,
            "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = [run(name, args.steps) for name in FAMILIES]
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "none"
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "backend": backend, "rows": rows}, indent=1))
        return
    print(f"{torch.cuda.get_device_name()}, backend {backend}")
    for r in rows:
        print(f"{r['family']:8s} max rel diff {r['max_rel_diff']:.1e}  losses {[round(x, 5) for x in r['losses']]}")


if __name__ == "__main__":
    main()
