"""Gradient compression across settings, and beside torch's own DDP hooks (`compression.py --sweep`,
`--part anchor`).

The sweep: every method with a target (`TARGETS`: PowerSGD, top-k, DGC, 1-bit SGD, TernGrad, QSGD,
and the `ef=0` twins of top-k and 1-bit for error feedback's comparison) and dense training × 3
seeds × 2 global batches (64, 256) × 2 learning rates × 2 rank counts (2, 4), on two tasks over scikit-learn's digits: the MLP 64-256-256-10 of the convergence part
(lr 0.05 and 0.1) and a small CNN (two 3×3 convolutions of 16 and 32 channels, a 2×2 max-pool, a
linear layer; lr 0.05 and 0.1), each run a fixed number of steps (`--sweep-steps`, default 160)
of SGD with momentum 0.9 (DGC and 1-bit SGD: their own momentum), pure data parallel through
`autopar.parallelize`. Each method's final test accuracy is
compared with dense training's on the same setting (task, seed, batch, lr, ranks); time to dense
accuracy is the training time (evaluation every `--eval-every` steps excluded) until a run first
reaches dense's final accuracy. fp16, random-k and signSGD (no target) run in the convergence
part only; threshold quantisation is left out: its τ is in the gradient's units, so no value
holds across tasks.

The anchor: torch ships PowerSGD and fp16 compression as DDP communication hooks. DDP with
`powerSGD_hook` (rank 2, error feedback, warm start; `start_powerSGD_iter=2`, the least torch
allows with those, so its first two steps are dense) runs beside `powersgd:2,start=2,min_size=0`
(the same start, no size floor: torch's hook has none), and DDP with `fp16_compress_hook` beside
`fp16,min_size=0`, on the same data, seeds, model and optimizer: test accuracy,
bytes handed to collectives per step and rank, and median step time.

Both run through `compression.py`, which prints their tables (`sweep_table`, `anchor_table`) and
writes each to its own page fragment: docs/benchmarks/results/compression_sweep.md and
compression_anchor.md. With `--record FILE` the sweep appends each finished run to FILE (JSON
lines) and, started again, reads back the runs FILE holds instead of running them: a long sweep
resumes where it stopped.

The accuracy runs compress every gradient the method's own rules take (`every_gradient`: a weight
matrix past the size floor that it shrinks `min_rate` times on the wire; both models' two large
matrices), whatever a link would make of it: the question there is whether the method holds its
accuracy wherever it is used. Time is judged on
the link the plan would run over (`--rate`, 100 Mb/s): each method's step is measured once per
task, batch and rank count on that link shaped for real (`compression.on_link`, as root), planned
for it, so where the planner sends a bucket dense there (the digits CNN's 40 KB gradient, no
bucket of it priced `min_rate` times faster compressed) the method runs dense and reaches dense's
accuracy when dense does, at its own step time. `--rerun` runs a method's recorded runs again
after a change to how it trains, `--link-again` the link's step times after one to what the
planner sends compressed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from compression import Digits, _spawn, batch_stream, link_cluster, load_data, method, mlp, rate_bytes
from torch import nn

# method → accuracy points it may lose against dense in every setting (None: reported only, for
# error feedback's comparison); fp16, random-k and signSGD have no target and run in the
# convergence part only, which keeps the sweep within 30 minutes
TARGETS: dict[str, float | None] = {
    "powersgd:2": 1.0, "topk:0.01": 1.0, "topk:0.01,ef=0": None, "dgc:0.999": 1.0, "onebit": 1.0,
    "onebit,ef=0": None, "terngrad": 2.0, "qsgd:16": 2.0,
}
SEEDS = (0, 1, 2)
BATCHES = (64, 256)
RANKS = (2, 4)


def cnn(seed: int | None) -> nn.Module:
    """8×8 digits → conv 16 → conv 32 → max-pool → linear 10 (9.9k parameters)."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 4 * 4, 10))


@dataclass(frozen=True)
class Task:
    name: str
    title: str
    lrs: tuple[float, float]

    def model(self, seed: int | None) -> nn.Module:
        return mlp(256, seed) if self.name == "mlp" else cnn(seed)


TASKS = {"mlp": Task("mlp", "digits MLP 64-256-256-10", (0.05, 0.1)),
         "cnn": Task("cnn", "digits CNN conv16-conv32-pool-linear", (0.05, 0.1))}


@torch.no_grad()
def accuracy(pm: Any, task: Task, data: Digits) -> float:
    model = task.model(None)
    model.load_state_dict(pm.full_state_dict())
    return 100.0 * float((model(data.x_test).argmax(1) == data.y_test).float().mean())


@dataclass
class Run:
    task: str
    method: str
    ranks: int
    batch: int
    lr: float
    seed: int
    accuracy: float
    diverged: bool
    seconds: float  # training time, evaluations excluded
    bytes_sent: float  # per rank per step, mean over the run
    bytes_raw: float
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, seconds, accuracy)
    compressed: list[str] | None = None  # the parameters the run's plan compressed (dense: None)


def every_gradient(plan: Any, spec: str, model: nn.Module, world: int) -> Any:
    """`plan` compressing with `spec` every gradient the method's own rules take (`compresses` with
    no link: a weight matrix, the size floor, the rate on the wire), listed as the planner lists
    what it decides (`dp_gradient.compressed`), so that no link's pricing leaves one dense."""
    from autopar.contract.compression import parse
    from autopar.cost_models.compression import compresses

    s = parse(spec)
    listed = sorted(n for n, p in model.named_parameters() if compresses(s, tuple(p.shape), world))
    return plan.with_gradient(compression=s.canonical(), compressed=listed)


def _build(task: Task, spec: str, world: int, batch: int, lr: float, seed: int, data: Digits, rank: int,
           plans: dict, rate: str | None) -> Any:
    """The task's model under `spec` on `world` ranks, planned for a link of `rate`; with none,
    compressing every gradient it can take (`every_gradient`) in dense's plan."""
    m = method(spec, None if spec == "none" else spec, lr)
    if rate is None and m.compression is not None and (task.name, batch, world) not in plans:
        _build(task, "none", world, batch, lr, seed, data, rank, plans, None)  # dense's plan, to compress in
    model = task.model(seed)
    torch.manual_seed(seed + 1 + rank)  # stochastic compressors draw differently on each rank

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=m.lr, momentum=m.momentum)

    import autopar

    plan = plans.get((task.name, batch, world), f"{world},1,1")
    if rate is None and m.compression is not None:
        plan = every_gradient(plan, m.compression, model, world)
    pm = autopar.parallelize(model, (1, world), (data.x_train[:batch],), loss_fn=F.cross_entropy, optimizer=optimizer,
                             plan=plan, compression=m.compression, cluster=link_cluster(world, rate_bytes(rate or "100mbit")))
    if m.compression is None:  # the same layout serves every method of this task and batch: planned once
        plans[(task.name, batch, world)] = pm.plan
    return pm


def train_one(task: Task, spec: str, world: int, batch: int, lr: float, seed: int, data: Digits, steps: int,
              eval_every: int, rank: int, plans: dict) -> Run:
    pm = _build(task, spec, world, batch, lr, seed, data, rank, plans, None)
    stream = batch_stream(data, batch, seed)
    clock, sent, raw, curve, loss = 0.0, 0, 0, [], 0.0
    for step in range(1, steps + 1):
        x, y = next(stream)
        start = time.perf_counter()
        loss = pm.step(x, y)
        clock += time.perf_counter() - start
        stats = pm.comm_stats()["dp"]
        sent, raw = sent + stats["bytes_sent"], raw + stats["bytes_raw"]
        if step % eval_every == 0 or step == steps:
            curve.append((step, clock, accuracy(pm, task, data)))
    return Run(task.name, spec, world, batch, lr, seed, curve[-1][2], not math.isfinite(loss), clock,
               sent / steps, raw / steps, curve, pm.plan.dp_gradient.get("compressed"))


def canonical(spec: str) -> str:
    """A method with every default written out (`Spec.canonical`): what names it in a record, so a
    changed default is a different run and a spec spelt otherwise the same one."""
    from autopar.contract.compression import parse

    return spec if spec == "none" else parse(spec).canonical()


def _key(task: str, spec: str, world: int, batch: int, lr: float, seed: int, steps: int) -> str:
    """What names a run in the record: its setting, method and length."""
    return json.dumps([task, canonical(spec), world, batch, lr, seed, steps])


def _sweep_rank(rank: int, world: int, args: argparse.Namespace) -> list[Run]:
    """This rank count's share of the sweep; each run rank 0 finishes is appended to `args.record`
    at once, and the runs already there (`args.done`) are skipped, on every rank alike."""
    data = {seed: load_data(seed) for seed in SEEDS}
    runs, plans, done = [], {}, set(args.done)
    settings = [(t, b, lr, s) for t in args.tasks for b in args.batches for lr in (args.lrs or TASKS[t].lrs)
                for s in SEEDS]
    for i, (t, batch, lr, seed) in enumerate(settings):
        for spec in ["none", *args.methods]:
            if _key(t, spec, world, batch, lr, seed, args.sweep_steps) in done:
                continue
            runs.append(train_one(TASKS[t], spec, world, batch, lr, seed, data[seed], args.sweep_steps,
                                  args.eval_every, rank, plans))
            if rank == 0 and args.record:
                with open(args.record, "a") as f:
                    f.write(json.dumps({"key": _key(t, spec, world, batch, lr, seed, args.sweep_steps),
                                        "run": asdict(runs[-1])}) + "\n")
        if rank == 0:
            row = [r for r in runs if (r.task, r.batch, r.lr, r.seed) == (t, batch, lr, seed)]
            print(f"  [{world} ranks {i + 1}/{len(settings)}] {t} batch {batch} lr {lr:g} seed {seed}: "
                  + " ".join(f"{r.method} {r.accuracy:.1f}" for r in row), file=sys.stderr, flush=True)
    return runs


def recorded(path: str | None) -> tuple[dict[str, Run], dict]:
    """The runs a record holds (JSON lines, one per finished run), by key, and the link's step
    times it holds (each measured entry: `_link_key`, the last measured); nothing without one."""
    runs: dict[str, Run] = {}
    times: dict = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                entry = json.loads(line)
                if entry["key"] == "link":
                    times.update(entry["times"])
                else:
                    runs[entry["key"]] = Run(**{**entry["run"], "curve": [tuple(c) for c in entry["run"]["curve"]]})
    return runs, times


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    from compression import on_link

    done, times = recorded(args.record)
    for world in args.ranks if args.link_times else ():  # each method's step on the shaped link
        wanted = {_link_key(t, spec, b, world) for t in args.tasks for b in args.batches for spec in ["none", *args.methods]}
        if wanted <= set(times) and not args.link_again:
            continue
        print(f"sweep: step times on the {args.rate} link, {world} ranks", file=sys.stderr)
        measured = on_link(args, ranks=world, mode="steps")
        if "skipped" in measured:
            break
        times.update(measured)
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps({"key": "link", "rate": args.rate, "ranks": world, "times": measured}) + "\n")
    named = {_key(t, spec, world, b, lr, s, args.sweep_steps): spec for world in args.ranks for t in args.tasks
             for b in args.batches for lr in (args.lrs or TASKS[t].lrs) for s in SEEDS for spec in ["none", *args.methods]}
    again = {canonical(m) for m in args.rerun}
    # (a list: the link's ranks are handed the arguments as JSON)
    args.done = sorted(k for k in set(done) & set(named) if json.loads(k)[1] not in again)
    print(f"sweep: {len(args.methods) + 1} methods × {len(SEEDS)} seeds × batches {args.batches} × lrs "
          f"{args.lrs or 'per task'} × ranks {args.ranks} × tasks {args.tasks}, {args.sweep_steps} steps each"
          + (f"; {len(args.done)} of {len(named)} runs read back from {args.record}" if args.done else ""),
          file=sys.stderr)
    runs: list[Run] = [replace(done[k], method=named[k]) for k in args.done]  # as this sweep spells the method
    for world in args.ranks:
        if any(json.loads(k)[2] == world for k in set(named) - set(args.done)):
            runs += _spawn(_sweep_rank, world, args)
    result = {"steps": args.sweep_steps, "eval_every": args.eval_every, "seeds": list(SEEDS), "batches": args.batches,
              "ranks": args.ranks,
              "tasks": {t: {"title": TASKS[t].title, "lrs": args.lrs or list(TASKS[t].lrs)} for t in args.tasks},
              "link_rate": args.rate if times else None, "link_times": times,
              "runs": [asdict(r) for r in runs], "summary": summarize(runs, times or {})}
    if set(args.tasks) == set(TASKS):
        write_verdict(result)
    else:
        print(f"sweep: the verdict (`--compression auto`'s candidates) is written by a sweep of every task "
              f"({', '.join(TASKS)}), not of {', '.join(args.tasks)}", file=sys.stderr)
    return result


def write_verdict(result: dict[str, Any]) -> None:
    """The package's `cost_models.compression.VERDICT`: per method with a target, whether it met it
    on every task, its worst and median gaps there, and the range the sweep measured (ranks,
    samples a rank, parameters): `--compression auto` weighs only what held, and a method used
    outside that range warns (`cost_models.compression.unmeasured`)."""
    from _stamp import stamp

    from autopar.cost_models.compression import VERDICT

    params = {t: sum(p.numel() for p in TASKS[t].model(0).parameters()) for t in result["tasks"]}
    methods = {}
    for text, target in TARGETS.items():
        rows = [s for s in result["summary"] if s["method"] == text]
        if target is None or {s["task"] for s in rows} != set(result["tasks"]):
            continue
        methods[text] = {"held": all(s["meets"] for s in rows), "target": target,
                         "worst_gap": min(s["worst_gap"] for s in rows),
                         "tasks": {s["task"]: {k: s[k] for k in ("worst_gap", "median_gap", "settings",
                                                                 "link_ratio_median", "link_sooner")} for s in rows}}
    span = {"ranks": [min(result["ranks"]), max(result["ranks"])],
            "local_batch": [min(result["batches"]) // max(result["ranks"]), max(result["batches"]) // min(result["ranks"])],
            "params": [min(params.values()), max(params.values())]}
    VERDICT.write_text(json.dumps({
        "schema": "autopar.compression_verdict/1", "written": stamp(),
        "command": "python benchmarks/" + " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "steps": result["steps"], "models": [f"{TASKS[t].title} ({params[t]:,} parameters)" for t in result["tasks"]],
        "range": span, "methods": methods}, indent=1) + "\n")
    print(f"wrote {VERDICT} ({sum(m['held'] for m in methods.values())} of {len(methods)} methods held)", file=sys.stderr)


# steady steps timed per method on the shaped link, once it compresses as it will for the rest of a
# run: in rounds, every method's in turn (A B A B), so that a drift of the machine or the link falls
# on all of them alike
LINK_ROUNDS, LINK_STEPS = 5, 10


def warmup_steps(spec: str) -> int:
    """The steps before a method sends what it will send for the rest of a run: PowerSGD's dense
    start, DGC's and top-k's warm-up stages; 0 for the others (and dense)."""
    if spec == "none":
        return 0
    from autopar.contract.compression import DGC_STAGES, parse

    p = parse(spec)
    return int(p.option("start") + (DGC_STAGES * p.option("warmup") if p.method in ("dgc", "topk") else 0))


def link_step_times(rank: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """On the shaped link (a rank of `compression.on_link`'s): per task, batch and method, planned
    for this link, the median step over its warm-up (`warmup_steps`, its first two steps left out:
    set-up) and over `LINK_ROUNDS` × `LINK_STEPS` steps after it, and the parameters the plan
    compressed, by `_link_key`. Warm-ups and steady steps alike in rounds of `LINK_STEPS`, the
    methods' in turn."""
    world = dist.get_world_size()
    data, out, plans = load_data(SEEDS[0]), {}, {}

    def timed(pm: Any, stream: Any) -> float:
        x, y = next(stream)
        start = time.perf_counter()
        pm.step(x, y)  # ends in an all-reduce of the loss: every rank is past it
        return time.perf_counter() - start

    for t in args.tasks:
        for batch in args.batches:
            runs = {}
            for spec in ["none", *args.methods]:
                pm = _build(TASKS[t], spec, world, batch, (args.lrs or TASKS[t].lrs)[0], SEEDS[0], data, rank, plans,
                            args.rate)
                runs[spec] = (pm, batch_stream(data, batch, SEEDS[0]), warmup_steps(spec), [], [])
            while any(len(first) < warm + 2 for _, _, warm, first, _ in runs.values()):
                for pm, stream, warm, first, _ in runs.values():
                    first += [timed(pm, stream) for _ in range(min(LINK_STEPS, warm + 2 - len(first)))]
            for _ in range(LINK_ROUNDS):
                for pm, stream, _, _, steady in runs.values():
                    steady += [timed(pm, stream) for _ in range(LINK_STEPS)]
            for spec, (pm, _, warm, first, steady) in runs.items():
                warming = first[min(2, warm - 1):warm] if warm else []
                key = _link_key(t, spec, batch, world)
                out[key] = {"warmup_steps": warm, "warm_s": statistics.median(warming) if warming else 0.0,
                            "steady_s": statistics.median(steady), "compressed": pm.plan.dp_gradient.get("compressed")}
                if rank == 0:
                    print(f"  link: {t} batch {batch} {world} ranks {spec}: {1e3 * out[key]['steady_s']:.1f} ms a step, "
                          f"{len(out[key]['compressed'] or [])} compressed", file=sys.stderr, flush=True)
    return out


def _link_key(task: str, spec: str, batch: int, ranks: int) -> str:
    return json.dumps([task, canonical(spec), batch, ranks])


def link_time(r: Run, steps: int, times: dict[str, dict[str, Any]]) -> float | None:
    """Seconds `steps` steps of run `r`'s method take on the shaped link, as measured on its rank
    count: its warm-up's steps at their time, the rest at the steady one."""
    t = times.get(_link_key(r.task, r.method, r.batch, r.ranks))
    if t is None:
        return None
    warm = min(steps, t["warmup_steps"])
    return warm * t["warm_s"] + (steps - warm) * t["steady_s"]


def dense_on_link(r: Run, times: dict[str, dict[str, Any]]) -> bool:
    """Whether run `r`'s method, planned for the shaped link, sends every gradient dense there."""
    t = times.get(_link_key(r.task, r.method, r.batch, r.ranks))
    return t is not None and r.method != "none" and not t["compressed"]


def _setting(r: Run) -> tuple:
    return (r.task, r.ranks, r.batch, r.lr, r.seed)


def _reached(r: Run, target: float) -> tuple[int, float] | None:
    return next(((s, t) for s, t, a in r.curve if a >= target), None)


def summarize(runs: list[Run], times: dict[str, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Per task and method: the worst and median gap to dense over the settings, the setting of the
    worst, the target and whether every setting meets it; how often and how fast (against dense's
    own time to its final accuracy) a method reached dense's final accuracy; on the shaped link
    (`times`, `link_step_times`), the time to dense's final accuracy less a point, the steps from
    the run times each step's time there, against dense's own, and in how many settings it got
    there sooner; for a method with an `ef=0` twin, whether error feedback did better wherever the
    twin lost more than a point."""
    dense = {_setting(r): r for r in runs if r.method == "none"}
    by: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        by.setdefault((r.task, r.method), []).append(r)
    out = []
    for (task, name), rs in by.items():
        gaps = [(r.accuracy - dense[_setting(r)].accuracy, r) for r in rs]
        worst = min(gaps, key=lambda g: g[0])
        speed = []
        for r in rs:
            d = dense[_setting(r)]
            mine, theirs = _reached(r, d.accuracy), _reached(d, d.accuracy)
            if mine and theirs:
                speed.append(mine[1] / theirs[1])
        on_link = []  # per setting: this method's time to dense's final accuracy - 1 point over dense's
        tenfold = []  # and whether its plan for the link compresses ten times or more there
        times = times or {}
        for r in rs:
            d = dense[_setting(r)]
            # planned dense for the link, the method trains as dense does there (at its own step time)
            mine, theirs = _reached(d if dense_on_link(r, times) else r, d.accuracy - 1.0), _reached(d, d.accuracy - 1.0)
            mine_s = link_time(r, mine[0], times) if mine else None
            theirs_s = link_time(d, theirs[0], times) if theirs else None
            if theirs_s:
                on_link.append(mine_s / theirs_s if mine_s is not None else math.inf)
                # over the run, as the accuracy run sent (the link's plan compressing the same), or dense
                tenfold.append(not dense_on_link(r, times) and r.bytes_raw / max(1.0, r.bytes_sent) >= 10)
                linked = times.get(_link_key(r.task, r.method, r.batch, r.ranks), {}).get("compressed")
                if linked and r.compressed is not None and sorted(linked) != sorted(r.compressed):
                    print(f"sweep: {r.task} {r.method} on {r.ranks} ranks compresses {linked} on the link but ran "
                          f"{r.compressed}: its time there is approximate", file=sys.stderr)
        target = TARGETS.get(name)
        row = {"task": task, "method": name, "settings": len(rs), "worst_gap": worst[0],
               "worst_at": {"ranks": worst[1].ranks, "batch": worst[1].batch, "lr": worst[1].lr, "seed": worst[1].seed},
               "median_gap": statistics.median(g for g, _ in gaps), "target": target,
               "meets": None if target is None or name == "none" else worst[0] >= -target,
               "reached": len(speed), "time_ratio_median": statistics.median(speed) if speed else None,
               "link_ratio_median": statistics.median(on_link) if on_link else None,
               "link_sooner": f"{sum(x < 1 for x in on_link)}/{len(on_link)}" if on_link else None,
               "link_dense": f"{sum(dense_on_link(r, times) for r in rs)}/{len(rs)}" if times else None,
               # where its plan compresses >= 10x on the link, it gets there sooner than dense
               "link_tenfold": f"{sum(tenfold)}/{len(tenfold)}" if on_link else None,
               "link_meets": all(x < 1 for x, ten in zip(on_link, tenfold) if ten) if on_link else None,
               "ratio": statistics.median(r.bytes_raw / max(1.0, r.bytes_sent) for r in rs)}
        twin = by.get((task, name + ",ef=0"))
        if twin:
            without = {_setting(r): r for r in twin}
            losing = [r for r in rs if without[_setting(r)].accuracy - dense[_setting(r)].accuracy < -1.0]
            row["ef_better"] = f"{sum(r.accuracy > without[_setting(r)].accuracy for r in losing)}/{len(losing)}"
        out.append(row)
    return out


def sweep_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    lrs = {t: v["lrs"] for t, v in result["tasks"].items()}
    n = len(result["seeds"]) * len(result["batches"]) * len(next(iter(lrs.values()))) * len(result["ranks"])
    title = (f"Sweep: {n} settings per task (seeds {result['seeds']}, batches {result['batches']}, learning rates "
             f"{', '.join(f'{t} {v}' for t, v in lrs.items())}, ranks {result['ranks']}), {result['steps']} steps "
             "each; gaps in test accuracy points against dense on the same setting")
    rows = []
    for s in result["summary"]:
        if s["method"] == "none":
            continue
        w = s["worst_at"]
        rows.append([s["task"], s["method"], f"{s['worst_gap']:+.2f}", f"{s['median_gap']:+.2f}",
                     f"{w['ranks']} ranks, batch {w['batch']}, lr {w['lr']:g}, seed {w['seed']}",
                     f"{s['ratio']:.1f}×", f"{s['reached']}/{s['settings']}",
                     f"{s['time_ratio_median']:.2f}" if s["time_ratio_median"] else "—",
                     (f"{s['link_ratio_median']:.2f} ({s['link_sooner']} sooner"
                      + (f"; planned dense in {s['link_dense']}" if not s["link_dense"].startswith("0/") else "") + ")"
                      if s.get("link_ratio_median") is not None else "—"),
                     ("—" if s.get("link_meets") is None or s["link_tenfold"].startswith("0/") else
                      f"{'yes' if s['link_meets'] else 'NO'} ({s['link_tenfold']})"),
                     s.get("ef_better", "—"),
                     "—" if s["target"] is None else f"≥ −{s['target']:g}",
                     "—" if s["meets"] is None else ("yes" if s["meets"] else "NO")])
    return title, ["task", "method", "worst gap", "median gap", "worst at", "bytes ratio", "reached dense acc",
                   "time to dense acc (× dense)", f"on {result.get('link_rate') or 'the link'}: time to dense − 1 pt "
                   "(× dense)", "sooner wherever ≥ 10× there (settings ≥ 10×)", "EF better where ef=0 loses > 1",
                   "target", "meets"], rows


# ---- the anchor: torch's DDP hooks -----------------------------------------------------------------


@dataclass
class AnchorRow:
    method: str
    seed: int
    accuracy: float
    bytes_sent: float  # per rank per step, mean over the run
    step_ms: float  # median


def _ddp(hook: str, task: Task, world: int, batch: int, lr: float, seed: int, data: Digits, steps: int,
         rank: int) -> AnchorRow:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = task.model(seed)
    torch.manual_seed(seed + 1 + rank)
    ddp = DDP(model)
    n = sum(p.numel() for p in model.parameters())
    state = None
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        state = psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                   use_error_feedback=True, warm_start=True, random_seed=seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    stream = batch_stream(data, batch, seed)
    local = batch // world
    times = []
    for _ in range(steps):
        x, y = next(stream)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if state is None:
        sent = 2.0 * n
    else:  # torch counts elements before and after compression over the steps it compressed
        _, before, after = state.compression_stats()
        compressed_steps = steps - 2
        sent = (2 * 4.0 * n + compressed_steps * 4.0 * after / max(1, before) * n) / steps
    with torch.no_grad():
        acc = 100.0 * float((model(data.x_test).argmax(1) == data.y_test).float().mean())
    return AnchorRow(f"DDP {'fp16_compress_hook' if hook == 'fp16' else 'powerSGD_hook rank 2'}", seed, acc, sent,
                     1e3 * statistics.median(times))


def _ours(spec: str, task: Task, world: int, batch: int, lr: float, seed: int, data: Digits, steps: int,
          rank: int) -> AnchorRow:
    pm = _build(task, spec, world, batch, lr, seed, data, rank, {}, None)  # compressing all it can, as torch's hook
    stream = batch_stream(data, batch, seed)
    times, sent = [], 0
    for _ in range(steps):
        x, y = next(stream)
        start = time.perf_counter()
        pm.step(x, y)
        times.append(time.perf_counter() - start)
        sent += pm.comm_stats()["dp"]["bytes_sent"]
    return AnchorRow(f"autopar {spec}", seed, accuracy(pm, task, data), sent / steps, 1e3 * statistics.median(times))


def _anchor_rank(rank: int, world: int, args: argparse.Namespace) -> list[AnchorRow]:
    task = TASKS["mlp"]
    rows = []
    for seed in SEEDS:
        data = load_data(seed)
        # torch's hook as configured there: its first two steps dense, no size floor
        for ours, theirs in (("powersgd:2,start=2,min_size=0", "powersgd"), ("fp16,min_size=0", "fp16")):
            dist.barrier()
            rows.append(_ours(ours, task, world, args.batch, args.lr, seed, data, args.sweep_steps, rank))
            dist.barrier()
            rows.append(_ddp(theirs, task, world, args.batch, args.lr, seed, data, args.sweep_steps, rank))
        if rank == 0:
            print("  seed", seed, " ".join(f"{r.method}: {r.accuracy:.2f}" for r in rows[-4:]), file=sys.stderr, flush=True)
    return rows


def run_anchor(args: argparse.Namespace) -> dict[str, Any]:
    print(f"anchor: torch's DDP hooks beside autopar, {args.nproc} ranks, {args.sweep_steps} steps", file=sys.stderr)
    rows = _spawn(_anchor_rank, args.nproc, args)
    return {"ranks": args.nproc, "batch": args.batch, "lr": args.lr, "steps": args.sweep_steps,
            "rows": [asdict(r) for r in rows]}


def anchor_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    title = (f"Beside torch's DDP hooks: digits MLP, {result['ranks']} ranks, batch {result['batch']}, lr "
             f"{result['lr']:g}, {result['steps']} steps, seeds {list(SEEDS)} (mean, min–max)")
    by: dict[str, list[dict]] = {}
    for r in result["rows"]:
        by.setdefault(r["method"], []).append(r)
    rows = []
    for name, rs in by.items():
        acc = [r["accuracy"] for r in rs]
        rows.append([name, f"{statistics.fmean(acc):.2f} ({min(acc):.2f}–{max(acc):.2f})",
                     f"{statistics.fmean(r['bytes_sent'] for r in rs) / 1e3:,.1f} kB",
                     f"{statistics.median(r['step_ms'] for r in rs):.2f}"])
    return title, ["averaging", "test acc %", "sent/step/rank", "median ms/step"], rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sweep", action="store_true", help="the robustness sweep (same as --part sweep)")
    ap.add_argument("--sweep-steps", type=int, default=160, help="steps per run of the sweep and the anchor")
    ap.add_argument("--no-link-times", dest="link_times", action="store_false", help="leave out the step times on "
                    "the shaped link (measured once per task, batch and method, as root: `compression.on_link`)")
    ap.add_argument("--link-again", action="store_true", help="measure the step times on the link again though the "
                    "record holds them: after a change to what the planner sends compressed there")
    ap.add_argument("--rerun", nargs="+", default=[], help="methods whose runs the record holds to run again (and "
                    "append: a record's last run of a key is the one read back), after a change to how they train")
    ap.add_argument("--record", default=None, help="JSON lines of the sweep's finished runs: each appended as it "
                    "finishes, and those already there (same setting, method and steps) read back, not run again")
    ap.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["mlp", "cnn"])
    ap.add_argument("--methods", nargs="+", default=list(TARGETS), help="methods of the sweep (dense always runs)")
    ap.add_argument("--lrs", nargs="+", type=float, default=None, help="learning rates instead of each task's pair")
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="global batches of the sweep")
    ap.add_argument("--ranks", nargs="+", type=int, default=list(RANKS), help="rank counts of the sweep")

