"""Checkpoints that any plan can load: `torch.distributed.checkpoint` (DCP) by model names.

Parameters, optimizer states and persistent buffers (BatchNorm's running statistics) are saved
under the model's own names, parameters with their DTensor layouts, so DCP reshards them on
load: a run saved under 4-way tensor parallelism resumes under 2×2 data × pipeline. A weight several pipeline stages hold (a tied embedding) is
saved once, from the first stage holding it, and loaded into every copy.

Atomic: every rank writes into `step-N.partial/`, and once all have, rank 0 writes a manifest of
every file's size and SHA-256 and renames the folder to `step-N` (a rename is atomic on a POSIX
file system); what is replaced or dropped is renamed to `*.trash` before it is deleted. A job killed
at any point leaves complete checkpoints only under `step-N` names. Multi-host jobs need a directory
every host sees (as DCP's file system writer does).

Verified: `latest()` takes the newest checkpoint whose files match its manifest, and warns of each
newer one that does not (a truncated shard, a file swapped or planted). Per-rank and trainer state
load with `weights_only=True`; DCP's `.metadata` is a pickle, so the manifest protects against
damage, not against someone who can write the directory (they can rewrite the manifest too): a
checkpoint directory must be trusted like code.

Owned: every folder this module makes holds a `.autopar` marker from its creation, and only such
folders are ever deleted; a user's `notes.partial` beside them is left alone (and named in a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from autopar.contract.errors import AutoparError
from autopar.contract.placements import spelled
from autopar.contract.plan import Plan

log = logging.getLogger(__name__)
_STEP = re.compile(r"step-(\d+)")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
MARKER = ".autopar"  # in every folder this module makes: the only folders it deletes
MANIFEST = "manifest.json"  # written last: every other file's size and SHA-256
_MANIFEST_LIMIT = 16 * 2**20  # bytes: a manifest larger than this is not one of ours


def latest(directory: str | Path, warn: bool = True) -> Path | None:
    """The newest checkpoint in `directory` whose files match its manifest, or None; each newer
    one that does not is skipped, with a warning naming the file (`warn`: a launcher looking ahead
    leaves the warning to the ranks). Call it on one rank and share the answer (`agreed_latest`):
    ranks reading a file system apart may disagree."""
    for _, path in reversed(_complete(directory)):
        problem = verify(path)
        if problem is None:
            return path
        if warn:
            log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def agreed_latest(directory: str | Path) -> Path | None:
    """`latest` as rank 0 sees it, on every rank."""
    found = [str(latest(directory) or "") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    return Path(found[0]) if found[0] else None


def agreed_verified(path: str | Path) -> Path:
    """`path` once rank 0 has verified it (every rank raises the same error when it fails)."""
    problem = [verify(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise AutoparError(f"checkpoint {path} cannot be used: {problem[0]}")
    return Path(path)


def _complete(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the `step-N` folders this module made, by step."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir()
                  if (m := _STEP.fullmatch(p.name)) and p.is_dir() and _ours(p))


def _ours(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def verify(path: str | Path) -> str | None:
    """Why the checkpoint at `path` must not be loaded (a file missing, truncated, changed or not in
    its manifest), or None when every file matches the manifest written with it."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (written by an older autopar, or not complete)"
    if manifest.stat().st_size > _MANIFEST_LIMIT:
        return f"{manifest} is larger than {_MANIFEST_LIMIT} bytes"
    try:
        files = json.loads(manifest.read_text())["files"]
        listed = {str(name): (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return f"{manifest} is not a manifest ({type(exc).__name__})"
    present = {p.name for p in path.iterdir()} - {MANIFEST}
    for name in sorted(present - set(listed)):
        return f"{path / name} is not in its manifest"
    for name, (size, digest) in sorted(listed.items()):
        file = path / name
        if "/" in name or name in ("", ".", "..") or not file.is_file() or file.is_symlink():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, its manifest says {size} (truncated or changed)"
        if _sha256(file) != digest:
            return f"{file} does not match its SHA-256 in the manifest (changed or damaged)"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(path: Path, step: int) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(path.iterdir())
             if p.is_file() and p.name != MANIFEST}
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": "autopar.checkpoint/1", "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)


def _clear_leftovers(root: Path) -> None:
    """Delete the `*.partial` / `*.trash` folders a killed job of ours left; leave anyone else's
    (named in one warning)."""
    foreign = []
    for stale in [*root.glob("*.partial"), *root.glob("*.trash")]:
        if _ours(stale):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            foreign.append(stale.name)
    if foreign:
        log.warning("%s holds %s, which autopar did not make: left alone", root, ", ".join(sorted(foreign)))


def _discard(path: Path) -> None:
    """Out of `latest`'s sight at once (a unique trash name), then deleted."""
    trash = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.trash")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def layout(plan: Plan) -> str:
    """What makes two plans run alike (stages, placements, microbatches, schedule, gradient
    handling), without what only describes them (estimates, costs, how the search went)."""
    stages = [{"layers": s.layers, "submesh": s.submesh, "logical_mesh": s.logical_mesh, "params": spelled(s.params),
               "ops": spelled(s.ops), "recompute": s.recompute} for s in plan.stages]
    return json.dumps({"stages": stages, "num_microbatches": plan.num_microbatches, "schedule": plan.schedule,
                       "dp_gradient": plan.dp_gradient, "batch": plan.batch}, sort_keys=True)


def is_step(path: str | Path) -> bool:
    """Whether `path` is named as a checkpoint folder is (step-N)."""
    return _STEP.fullmatch(Path(path).name) is not None


def step_of(path: str | Path) -> int:
    m = _STEP.fullmatch(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-N)")
    return int(m.group(1))


def _names(pm: Any) -> dict[str, str]:
    """Name of each trained parameter in its module -> its name in the user's model."""
    if hasattr(pm.trained, "model_names"):  # a ShardedGraph
        return pm.trained.model_names()
    return {n: n for n, _ in pm.trained.named_parameters()}


def _state(pm: Any, saving: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """What DCP saves or loads into: parameters and flattened optimizer state by model names, and
    each optimizer entry's key as torch's state-dict helpers name it. Saving leaves out the copies
    of weights a lower stage holds too (`pm.copies`)."""
    names = _names(pm)
    skip = getattr(pm, "copies", set()) if saving else set()
    state: dict[str, Any] = {f"model.{names[n]}": p.detach() for n, p in pm.trained.named_parameters()
                             if names[n] not in skip}
    state.update({f"buffer.{n}": b for n, b in pm.state_buffers.items()})  # running statistics, loaded in place
    torch_keys = {}
    for key, value in get_optimizer_state_dict(pm.trained, pm.optimizer, options=_FLAT).items():
        kind, rest = key.split(".", 1)  # "state.<param>.exp_avg", "param_groups.<param>.lr" (<param> may hold dots)
        name = next((n for n in names if rest.startswith(n + ".")), rest.split(".", 1)[0])
        field = rest[len(name) + 1:]
        if names.get(name, name) not in skip:
            ours = f"optim.{kind}.{names.get(name, name)}.{field}"
            state[ours], torch_keys[ours] = value, key
    return state, torch_keys


def save(pm: Any, directory: str | Path, step: int, trainer: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write a checkpoint of `pm` after `step` steps; every rank calls this. `trainer` (the data
    generator's state, the losses so far, an LR scheduler's state: anything torch.save takes) is
    kept beside it, and each rank's random state and synchroniser state (error feedback, delayed
    gradients) too. Keeps the `keep` checkpoints of the highest steps."""
    root = Path(directory)
    final, partial = root / f"step-{step}", root / f"step-{step}.partial"
    rank = dist.get_rank()
    problem = [None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(root)  # left by a job killed mid-save
        if partial.exists() or (final.exists() and not _ours(final)):
            problem[0] = (f"{partial if partial.exists() else final} is in the way and autopar did not make it: "
                          "move it, or pass another --checkpoint-dir")
        else:
            partial.mkdir()
            (partial / MARKER).write_text("made by autopar: deleted when no longer needed\n")
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise AutoparError(problem[0])
    dcp.save(_state(pm, saving=True)[0], checkpoint_id=str(partial))
    sync = getattr(pm, "sync", None)
    local = {"rng": torch.get_rng_state(), "world": dist.get_world_size(), "layout": layout(pm.plan),
             "sync": sync.state_dict() if sync is not None else None,
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    if getattr(sync, "replicas_differ", False):  # delayed averaging: each replica's own weights and moments
        local["replica"] = {"params": [p.detach().clone() for p in pm.trained.parameters()],
                            "optimizer": pm.optimizer.state_dict()}
    _atomic_save(local, partial / f"rank{rank}.pt")
    if rank == 0:
        _atomic_save({**(trainer or {}), "step": step}, partial / "trainer.pt")
    dist.barrier()
    if rank == 0:
        _write_manifest(partial, step)
        # a step saved again (redone after a resume): the old one goes aside first, so a kill at
        # any point leaves a complete step-N or the previous checkpoints
        if final.exists():
            _discard(final)
        os.rename(partial, final)
        _fsync_dir(root)
        for _, old in _complete(root)[:-keep]:
            _discard(old)
    dist.barrier()
    return final


def load(pm: Any, path: str | Path, verified: bool = False) -> dict[str, Any]:
    """Load a checkpoint into `pm` (whatever plan it was saved under) and return the trainer state
    saved with it ("step" included, and "exact": whether this rank's own state came back too).
    Random and synchroniser states come back only when the job runs the same layout on as many
    ranks; otherwise they start afresh, as a new layout's would, with a warning. Nothing is read
    before rank 0 has checked every file against the manifest (`verified`: `latest` already did)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise AutoparError(f"{path} is not a complete autopar checkpoint (no .metadata): "
                           "pass a step-N directory that `autopar train --checkpoint-dir` wrote")
    if not verified:
        agreed_verified(path)
    state, torch_keys = _state(pm, saving=False)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _check_fits(state, saved, path)
    missing = [k.removeprefix("buffer.") for k in state if k.startswith("buffer.") and k not in saved]
    if missing and dist.get_rank() == 0:  # written before checkpoints held buffers
        log.warning("%s holds no %s: those buffers keep this model's values", path, ", ".join(missing))
    state = {k: v for k, v in state.items() if k in saved or not k.startswith("buffer.")}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(pm.trained, pm.optimizer, {torch_keys[k]: state[k] for k in torch_keys}, options=_FLAT)
    mine = path / f"rank{dist.get_rank()}.pt"

    problem = None
    try:
        local = _load_plain(mine) if mine.is_file() else None
    except AutoparError as exc:  # every rank stops with it, none waits for the others
        problem, local = str(exc), None
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise AutoparError(next(p for p in problems if p))
    exact = local is not None and local["world"] == dist.get_world_size() and local["layout"] == layout(pm.plan)
    if not exact and dist.get_rank() == 0:
        log.warning("%s was saved under another layout or world size: parameters and optimizer state loaded, "
                    "random and gradient-synchroniser state (compressor memories, delayed gradients) start afresh",
                    path)
    if exact:
        torch.set_rng_state(local["rng"])
        if local["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(local["cuda_rng"])
        if local["sync"] is not None and getattr(pm, "sync", None) is not None:
            pm.sync.load_state_dict(local["sync"])
        if "replica" in local:
            with torch.no_grad():
                for p, saved in zip(pm.trained.parameters(), local["replica"]["params"]):
                    p.copy_(saved)
            pm.optimizer.load_state_dict(local["replica"]["optimizer"])
    return {**_load_plain(path / "trainer.pt"), "exact": exact}


def _load_plain(path: Path) -> Any:
    """torch.load of tensors and plain values only: a pickle that would build anything else (run
    code) is refused with the file's name."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise AutoparError(f"{path} holds something other than tensors and plain values, refused unread "
                           f"({str(exc).splitlines()[0][:200]}): trust a checkpoint directory like code") from None


def _check_fits(state: dict[str, Any], saved: dict[str, Any], path: Path) -> None:
    """One clear message for a checkpoint of another model, instead of DCP's error from deep inside."""
    params = [k for k in state if k.startswith("model.")]
    missing = [k.removeprefix("model.") for k in params if k not in saved]
    if missing:
        raise AutoparError(f"{path} holds no {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''} "
                           f"({len(missing)} of this model's {len(params)} parameters): it was saved for another model")
    wrong = [(k.removeprefix("model."), tuple(saved[k].size), tuple(state[k].shape)) for k in params
             if hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(state[k].shape)]
    if wrong:
        name, had, want = wrong[0]
        raise AutoparError(f"{path} holds {name} of shape {list(had)}, this model's is {list(want)} "
                           f"({len(wrong)} parameters differ): it was saved for another model or configuration")


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
