"""`autopar train`: real training steps on synthetic data, launched through torchrun's launcher."""

from __future__ import annotations

import resource
import statistics
import time
import uuid
from typing import Any

import torch

from runtime.backend import free_port


def worker(model: str, plan: str | None, steps: int, batch: int | None, cluster: str | None,
           compression: str | None = None, delay: int = 0) -> dict[str, Any]:
    """One rank: build the zoo model on this rank's device, parallelize it, train `steps` steps.

    Errors the user can fix come back as {"error": message} so the launcher reports them as such."""
    import torch.distributed as dist

    import autopar
    from autopar.errors import AutoparError
    from runtime import local_device

    try:
        torch.manual_seed(0)  # every rank builds the same initial weights
        w = autopar.load_workload(model, batch=batch, device="cpu", dtype=torch.float32)
        if w.make_batch is None or w.loss_fn is None:
            raise AutoparError(f"{model} has no loss and synthetic batches: return (model, inputs, loss_fn, "
                               "make_batch) from your model function")
        pm = autopar.parallelize(w.model, None, w.example_inputs, loss_fn=w.loss_fn, plan=plan, cluster=cluster,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), compression=compression,
                                 delay=delay)
        gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
        losses, times = [], []
        for _ in range(steps):
            inputs, target = w.make_batch(w.batch, gen)
            dist.barrier()
            start = time.perf_counter()
            losses.append(pm.step(inputs, target))
            times.append(time.perf_counter() - start)
        peak = (torch.cuda.max_memory_allocated() if local_device(dist.get_rank()).type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return {"losses": losses, "step_times_s": times, "batch": w.batch, "plan": pm.plan.name,
                "compression": pm.plan.dp_gradient.get("compression"),
                "peak_memory_bytes": peak, "comm": pm.comm_stats()}
    except AutoparError as exc:
        return {"error": str(exc)}


def launch(model: str, nproc: int, plan: str | None, steps: int, batch: int | None,
           cluster: str | None, compression: str | None = None, delay: int = 0) -> dict[str, Any]:
    """Run `worker` on `nproc` local ranks with torch.distributed.run's launcher; summarise."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from autopar.errors import AutoparError

    port = free_port()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    try:
        results = elastic_launch(config, worker)(model, plan, steps, batch, cluster, compression, delay)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise AutoparError(f"rank {rank} failed: {failure.message or failure.error_file}") from None
    ranks = [results[r] for r in sorted(results)]
    errors = {r["error"] for r in ranks if "error" in r}
    if errors:
        raise AutoparError(errors.pop())
    first = ranks[0]
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(len(first["step_times_s"]))]
    step_time = statistics.median(per_step[1:] or per_step)  # the first step pays allocation and warm-up
    return {"model": model, "nproc": nproc, "plan": first["plan"], "compression": first["compression"],
            "delay": delay, "batch": first["batch"],
            "losses": first["losses"], "step_time_s": step_time, "samples_per_s": first["batch"] / step_time,
            "peak_memory_bytes": [r["peak_memory_bytes"] for r in ranks], "comm": first["comm"]}
