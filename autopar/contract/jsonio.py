"""JSON files written atomically (a crash leaves the old file or the new one, never half of one)
and read strictly: a regular file of bounded size, text, integers of bounded size, no duplicate
keys, bounded nesting. What is wrong comes back as one `ValueError` sentence. Non-finite numbers
(NaN, 1e400) are left to the field checks of plans and cluster files, which name the field."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any

MAX_BYTES = 64 * 2**20  # a plan of a 1000-stage model is a few MB
MAX_DIGITS = 30  # an integer longer than this is no size, count or time of ours
MAX_DEPTH = 64


def write_json(path: str | Path, data: Any) -> None:
    """Written to a temporary file of this writer's own beside it, then renamed into place: two
    processes writing one file (two launches filling the plan cache) each rename a whole one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in the regular file `path` (never a device, pipe or folder: they could block
    or never end). Raises FileNotFoundError, or ValueError saying what is wrong."""
    path = Path(path)
    info = os.stat(path)  # FileNotFoundError for the caller to word
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {path} is not a regular file")
    if info.st_size > MAX_BYTES:
        raise ValueError(f"{what} {path} has {info.st_size} bytes, more than the {MAX_BYTES} a {what} may have")
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not text (UTF-8 JSON)") from None
    return loads(text, f"{what} {path}")


def load_file(path: str | Path, what: str, error: type[Exception]) -> Any:
    """`read_json`, every failure one `error` whose message names the file and what went wrong."""
    try:
        return read_json(path, what)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except ValueError as exc:
        raise error(str(exc)) from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def loads(text: str, source: str) -> Any:
    """`json.loads`, strictly (see the module)."""
    try:
        data = json.loads(text, parse_int=_int, object_pairs_hook=_unique)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    except RecursionError:
        raise ValueError(f"{source} is nested too deeply to be JSON autopar wrote") from None
    if _depth(data) > MAX_DEPTH:
        raise ValueError(f"{source} is nested more than {MAX_DEPTH} levels deep")
    return data


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"the integer {text[:12]}… has {len(text)} digits: too large for any field")
    return int(text)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [v for x in level if isinstance(x, (dict, list)) for v in (x.values() if isinstance(x, dict) else x)]
        if depth > MAX_DEPTH:
            break
    return depth
