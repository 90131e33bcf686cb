"""Plans kept on disk: a relaunch with the same model, cluster, mesh, batch and options reuses the
plan the last launch searched instead of searching again (tens of seconds for a large model).

The key is a digest of everything that decides a plan: the captured graph's fingerprint (ops,
shapes, so the batch, dtypes, parameter names), its precision, the cluster (calibrated terms
included), the mesh, the memory limit, the schedule, the rule, the ILP's time limit, the data
axis's compressor, what was asked (the search's options or a hand-written layout) and the source
of the planner, cost models and contract (a changed cost model re-plans). A plan whose file
cannot be read is searched again and written over.

Where: `$AUTOPAR_PLAN_CACHE`, else `$XDG_CACHE_HOME/autopar/plans`, else `~/.cache/autopar/plans`;
`AUTOPAR_PLAN_CACHE=off` searches every time.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autopar.contract.plan import Plan, PlanError

log = logging.getLogger(__name__)

ENV = "AUTOPAR_PLAN_CACHE"
_PACKAGE = Path(__file__).resolve().parent.parent
_SOURCES = ("planner", "cost_models", "contract")


def directory() -> Path | None:
    """Where plans are kept (None: not kept)."""
    where = os.environ.get(ENV, "")
    if where.lower() in ("off", "0", "no", "false"):
        return None
    if where:
        return Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autopar" / "plans"


@functools.cache
def _code() -> str:
    """A digest of the source that prices and plans."""
    h = hashlib.sha256()
    for path in sorted(p for d in _SOURCES for p in (_PACKAGE / d).rglob("*.py")):
        h.update(path.relative_to(_PACKAGE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _rule(rule: Any) -> Any:
    """A layout rule by its fields, its letter function by name (not by address)."""
    if rule is None:
        return None
    return {f.name: (getattr(v, "__qualname__", repr(v)) if callable(v := getattr(rule, f.name)) else v)
            for f in dataclasses.fields(rule)}


def asked(layout: Any, stages: int | None, compression: str | None) -> dict[str, Any]:
    """What a plan was asked for: a hand-written layout (`planner.manual.Layout`) or the search
    (with a number of stages, or free), the data axis's compressor."""
    return {"layout": dataclasses.asdict(layout) if layout is not None else None, "stages": stages,
            "compression": compression}


def key(search: Any, asked: dict[str, Any]) -> str:
    """The digest a plan is kept under: `search` (`planner.search.Search`) and what was `asked` of it."""
    costs = search.costs
    what = {"graph": search.graph.fingerprint(), "precision": search.graph.precision,
            "cluster": search.cluster.to_dict(), "mesh": list(search.mesh), "memory_limit": search.memory_limit,
            "schedule": search.schedule, "virtual": search.virtual, "rule": _rule(costs.rule),
            "time_limit_s": costs.time_limit_s, "compression": repr(costs.compression), "asked": asked,
            "code": _code()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:24]


def cached(search: Any, asked: dict[str, Any], make: Callable[[], Plan],
           say: Callable[[str], None] | None = None) -> Plan:
    """The plan kept for this search and request, else `make()`'s, then kept. `say` (else the log)
    hears when a kept plan is reused, and from where."""
    where = directory()
    if where is None:
        return make()
    path = where / f"{key(search, asked)}.json"
    if path.exists():
        try:
            plan = Plan.load(path)
        except PlanError as exc:
            log.warning("the cached plan %s cannot be read (%s): planning again", path, exc)
        else:
            plan.search["cached"] = str(path)
            message = (f"reusing the plan cached at {path} (the same graph, cluster, mesh, batch and options); "
                       f"{ENV}=off plans again")
            (say or log.warning)(message)
            return plan
    plan = make()
    try:
        where.mkdir(parents=True, exist_ok=True)
        plan.save(path)
    except OSError as exc:  # a read-only home: plan every time, say why once per plan
        log.warning("cannot keep the plan in %s (%s); set %s to a writable directory, or to off", where, exc, ENV)
    return plan
