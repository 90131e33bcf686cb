"""How a tensor lies on one mesh axis, as DTensor names it: `Replicate`, `Shard(dim)`, `Partial`
(sums still to add). Plan files spell them "R", "S(d)" and "P" (`str` gives that spelling,
`parse_placement` reads it); the runtime maps them onto DTensor's own classes. Pure Python."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

_SPELLING = re.compile(r"R|P|S\((\d+)\)")


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial


def is_placement(text: object) -> bool:
    return isinstance(text, str) and _SPELLING.fullmatch(text) is not None


@functools.cache
def parse_placement(text: str) -> Placement:
    """"R", "P" or "S(d)"; ValueError for anything else."""
    if not is_placement(text):
        raise ValueError(f"not a placement: {text!r} (R, P or S(d))")
    if text == "R":
        return Replicate()
    return Partial() if text == "P" else Shard(int(text[2:-1]))


def placed(table: dict[str, list]) -> dict[str, list[Placement | None]]:
    """A table of placements typed, whether given typed or spelled ("S(0)": what the planner's
    passes compute with, and what a hand edit may write); ValueError for anything else."""
    return {key: [p if p is None or isinstance(p, (Replicate, Shard, Partial)) else parse_placement(p)
                  for p in value] for key, value in table.items()}


def spelled(table: dict[str, list[Placement | None]]) -> dict[str, list[str | None]]:
    return {key: [None if p is None else str(p) for p in value] for key, value in table.items()}
