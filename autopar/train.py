"""`autopar train`: real training steps on synthetic data, launched through torchrun's launcher,
with checkpoints to resume from and a report of the rank that died when one does."""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from autopar.api import parallelize
from autopar.contract.errors import AutoparError
from autopar.contract.limits import MAX_MEMORY_BYTES, MAX_SECONDS, check_counts
from autopar.models import load_workload
from autopar.planner.manual import Layout
from autopar.runtime import checkpoint, failures, local_device
from autopar.runtime.backend import LOOPBACK, local_store, register_loopback_rendezvous, same_hash_order
from autopar.runtime.checkpoint import is_step, latest, step_of, verify
from autopar.runtime.memory import measured_step

# after a rank fails, the others get SIGTERM, and SIGKILL this much later (torch's default is 30 s;
# `failures.reaping`): a frozen rank ignores SIGTERM, and checkpoints need no clean exit
SHUTDOWN_GRACE_S = 3


@dataclasses.dataclass(frozen=True)
class TrainJob:
    model: str
    nproc: int
    steps: int
    plan: str | None = None
    batch: int | None = None
    cluster: str | None = None
    compression: str | None = None
    delay: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only after the last step
    resume: bool = False
    timeout_s: float = 300.0
    mixed_precision: str | None = None  # "bf16" / "fp16" / "fp32"; None: the plan's
    memory_limit: float | None = None  # bytes of tensors per rank, planned for and held to
    resume_from: str | None = None  # a step-N folder (in checkpoint_dir, or a path): this one, not the latest
    compile: bool = False  # inductor compiles the lowered stages

    def resume_path(self) -> Path | None:
        """The checkpoint `resume_from` names: a path, or a name inside `checkpoint_dir`."""
        if self.resume_from is None:
            return None
        given = Path(self.resume_from)
        return given if given.is_dir() or self.checkpoint_dir is None else Path(self.checkpoint_dir) / given

    def check(self) -> None:
        check_counts(self.nproc, self.steps, self.checkpoint_every, self.delay)
        if self.checkpoint_every < 0:
            raise AutoparError(f"--checkpoint-every must be ≥ 0 steps, got {self.checkpoint_every}")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise AutoparError("--resume and --checkpoint-every need --checkpoint-dir DIR: where checkpoints go")
        if self.checkpoint_dir:
            _check_writable_dir(Path(self.checkpoint_dir))
        if self.resume_from is not None:
            path = self.resume_path()
            problem = ("no such checkpoint folder" if not path.is_dir() else
                       "not a step-N folder `autopar train` wrote" if not is_step(path) else verify(path))
            if problem:
                raise AutoparError(f"--resume-from {self.resume_from}: {problem}")
        if self.plan is not None and not self.plan.endswith(".json"):  # a layout: its size said before ranks start
            layout = Layout.parse(self.plan)
            if layout.dp * layout.tp * layout.pp != self.nproc:
                raise AutoparError(f"--plan {self.plan}: dp × tp × pp = {layout.dp * layout.tp * layout.pp}, the job "
                                   f"has {self.nproc} ranks: pass --nproc {layout.dp * layout.tp * layout.pp}, or a "
                                   f"layout of {self.nproc} devices")
        if self.memory_limit is not None and not 0 < self.memory_limit <= MAX_MEMORY_BYTES:
            raise AutoparError(f"--memory-limit must be a positive number of GiB, got {self.memory_limit / 2**30:g}")
        if not 0 < self.timeout_s <= MAX_SECONDS:
            raise AutoparError(f"--timeout must be a positive number of seconds, got {self.timeout_s} "
                               f"(at most {MAX_SECONDS:g})")
        if self.checkpoint_dir and not self.resume and self.resume_from is None:
            found = latest(self.checkpoint_dir)
            if found is not None:
                raise AutoparError(f"{self.checkpoint_dir} already holds checkpoints (up to {found.name}): pass "
                                   "--resume to continue from them, or another --checkpoint-dir")
        elif self.checkpoint_dir or self.resume_from is not None:  # resuming: from a step within --steps
            found = self.resume_path() if self.resume_from is not None else latest(self.checkpoint_dir, warn=False)
            if found is not None:
                within_steps(found, step_of(found), self.steps)


def within_steps(found: Path, step: int, steps: int) -> None:
    """A checkpoint at `step` resumes a job of `steps` steps only if it is not past them."""
    if step > steps:
        raise AutoparError(f"{found} is at step {step}, beyond --steps {steps}: ask for at least {step} steps")


def _check_writable_dir(path: Path) -> None:
    """A checkpoint folder the job can create and write, said before anything runs."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if path.exists() and not path.is_dir():
        raise AutoparError(f"--checkpoint-dir {path} is a file, not a folder: pass a folder (it is created if missing)")
    if existing is not None and not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise AutoparError(f"--checkpoint-dir {path}: {existing} is not a folder this user can write: pass another")


def worker(job: TrainJob, progress_dir: str) -> dict[str, Any]:
    """One rank: build the zoo model on this rank's device, parallelize it, train to `job.steps`,
    resuming from the latest checkpoint when asked. Any error fails the rank, so the launcher stops
    the others; one in the user's input is recorded as such and reported as it is."""
    import torch.distributed as dist


    # the launcher's number for this rank, known before the process group is: an error while
    # building the model or the plan is reported with its cause too
    rank, step, phase = int(os.environ.get("RANK", "0")), 0, "start"
    try:
        torch.manual_seed(0)  # every rank builds the same initial weights
        w = load_workload(job.model, batch=job.batch, device="cpu", dtype=torch.float32)
        if w.make_batch is None or w.loss_fn is None:
            raise AutoparError(f"{job.model} has no loss and synthetic batches: return (model, inputs, loss_fn, "
                               "make_batch) from your model function")
        pm = parallelize(w.model, None, w.example_inputs, loss_fn=w.loss_fn, plan=job.plan,
                         cluster=job.cluster, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                         compression=job.compression, delay=job.delay, timeout=job.timeout_s,
                         mixed_precision=job.mixed_precision, memory_limit=job.memory_limit, compile=job.compile)
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
        start, losses, resumed_from, exact = 0, [], None, True
        if job.resume_from is not None:
            found = checkpoint.agreed_verified(job.resume_path())
        else:
            found = checkpoint.agreed_latest(job.checkpoint_dir) if job.resume else None
        if found is not None:
            step, phase = checkpoint.step_of(found), "resume"
            failures.record(progress_dir, rank, step, phase)
            with failures.collective_failures(f"loading {found}", pm.failure_scope):
                saved = checkpoint.load(pm, found, verified=True)
            if "losses" not in saved or "data" not in saved:
                raise AutoparError(f"{found} was not written by `autopar train` (no losses or data order in it): "
                                   "resume it from Python with runtime.checkpoint.load")
            within_steps(found, saved["step"], job.steps)
            start, losses, resumed_from, exact = saved["step"], saved["losses"], str(found), saved["exact"]
            gen.set_state(saved["data"])
        if (job.resume or job.resume_from) and rank == 0:  # said now: a job killed later has said where it started
            print(f"resumed from {found} at step {start}" + ("" if exact else " (another layout: random and "
                  "compressor state afresh)") if found else f"no checkpoint in {job.checkpoint_dir}: starting at step 0",
                  file=sys.stderr, flush=True)
        times, tensor_bytes = [], None
        for step in range(start, job.steps):
            phase = "step"
            failures.record(progress_dir, rank, step, phase)
            inputs, target = w.make_batch(w.batch, gen)
            with failures.collective_failures(f"the barrier before step {step}", f"{pm.failure_scope}/barrier{step}"):
                dist.barrier()
            begin = time.perf_counter()
            if step == job.steps - 1:  # the last step counts its tensors (slower: not timed unless alone)
                loss, tensor_bytes = measured_step(pm, inputs, target)
                losses.append(loss)
                if not times:
                    times.append(time.perf_counter() - begin)
            else:
                losses.append(pm.step(inputs, target))
                times.append(time.perf_counter() - begin)
            done = step + 1
            if job.checkpoint_dir and (done == job.steps or job.checkpoint_every and done % job.checkpoint_every == 0):
                step, phase = done, "checkpoint"
                failures.record(progress_dir, rank, step, phase)
                with failures.collective_failures(f"saving the checkpoint of step {done}", f"{pm.failure_scope}/save{done}"):
                    checkpoint.save(pm, job.checkpoint_dir, done, {"losses": losses, "data": gen.get_state()})
        failures.record(progress_dir, rank, job.steps, "done")
        cuda = torch.cuda.max_memory_allocated() if local_device(rank).type == "cuda" else None
        return {"losses": losses, "start_step": start, "resumed_from": resumed_from, "exact_resume": exact,
                "step_times_s": times,
                "batch": w.batch, "plan": pm.plan.name, "compression": pm.plan.dp_gradient.get("compression"),
                "peak_tensor_bytes": tensor_bytes, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "peak_cuda_allocated_bytes": cuda, "comm": pm.comm_stats(), "programs": pm.programs()}
    except AutoparError as exc:
        # a peer's death is not the user's input; either way this rank fails, so the launcher stops
        # the others at once (a rank that returned would leave them waiting for it in a collective)
        peer = isinstance(exc, failures.PeerLost)
        failures.record(progress_dir, rank, step, phase, error=str(exc), user=not peer, peer=peer)
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the launcher reports it with the rank and step (DCP's CheckpointException
        # is a BaseException)
        failures.record(progress_dir, rank, step, phase, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        raise


def launch(job: TrainJob, quiet: bool = True) -> dict[str, Any]:
    """Run `worker` on `job.nproc` local ranks with torch.distributed.run's launcher; summarise.
    A rank that dies stops the job within the agent's monitor interval; the error names it and
    the step it died at."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch


    job.check()
    same_hash_order()
    with tempfile.TemporaryDirectory(prefix="autopar-progress-") as scratch, local_store() as port:
        progress_dir = str(Path(job.checkpoint_dir) / "progress") if job.checkpoint_dir else scratch
        Path(progress_dir).mkdir(parents=True, exist_ok=True)
        for stale in Path(progress_dir).glob("rank*.json"):
            stale.unlink()
        # torch 2.11's LaunchConfig has no shutdown_timeout (its agent waits its own default before SIGKILL)
        grace = ({"shutdown_timeout": SHUTDOWN_GRACE_S}
                 if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {})
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=job.nproc, run_id=uuid.uuid4().hex,
                              rdzv_backend=register_loopback_rendezvous(), rdzv_endpoint=f"{LOOPBACK}:{port}", rdzv_configs={"is_host": True},
                              local_addr=LOOPBACK, max_restarts=0,
                              monitor_interval=0.1, start_method="spawn", **grace)
        loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
        levels = [log.level for log in loggers]
        if quiet:  # the agent logs every failure with tracebacks; the error below says what happened
            for log in loggers:
                log.setLevel(logging.CRITICAL)
        seen: dict[int, failures.Watched] = {}
        try:
            with failures.reaping(progress_dir, job.nproc, SHUTDOWN_GRACE_S, seen):
                results = elastic_launch(config, worker)(job, progress_dir)
        except ChildFailedError as exc:
            given = failures.user_error(progress_dir, job.nproc)
            if given is not None:
                raise AutoparError(given) from None
            message = failures.blame(exc.failures, seen, job.steps)
            if job.checkpoint_dir:
                found = checkpoint.latest(job.checkpoint_dir)
                message += (f"; the latest checkpoint is {found}: run again with --resume" if found
                            else "; no checkpoint was written yet")
            raise AutoparError(message) from None
        finally:
            for log, level in zip(loggers, levels):
                log.setLevel(level)
    ranks = [results[r] for r in sorted(results)]
    first = ranks[0]
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(len(first["step_times_s"]))]
    step_time = statistics.median(per_step[1:] or per_step) if per_step else None  # None: nothing left to run
    return {"model": job.model, "nproc": job.nproc, "plan": first["plan"], "compression": first["compression"],
            "delay": job.delay, "batch": first["batch"], "start_step": first["start_step"],
            "exact_resume": all(r["exact_resume"] for r in ranks),
            "losses": first["losses"], "step_time_s": step_time, "samples_per_s": first["batch"] / step_time if step_time else None,
            "peak_tensor_bytes": [r["peak_tensor_bytes"] for r in ranks],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
            "peak_cuda_allocated_bytes": [r["peak_cuda_allocated_bytes"] for r in ranks], "comm": first["comm"],
            # how each stage ran (`runtime.lower.programs`): lowered with its collectives, or why not
            "programs": sorted({p["stage"]: p for r in ranks for p in r["programs"]}.values(), key=lambda p: p["stage"])}
