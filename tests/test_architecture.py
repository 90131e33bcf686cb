"""The import contract: floors import only downward, and nothing hides an import inside a function
to dodge a cycle. Read from the source with `ast`, so a violation fails here, not at a user's import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autopar"

# what each floor may import (besides itself); the entry floor is everything not listed here
ALLOWED = {
    "contract": set(),
    "cost_models": {"contract"},
    "planner": {"contract", "cost_models"},
    "runtime": {"contract"},
    "entry": {"contract", "cost_models", "planner", "runtime"},
}

# imports placed inside functions on purpose, each with its reason; any other is a failure. (The
# package's own names, `autopar.parallelize` and the rest, load on first use through `_EXPORTS` in
# `autopar/__init__.py`, so that `import autopar.cost_models` loads no torch.)
_STARTUP = "start-up: `autopar plan` and `--help` do not load torch.distributed's runtime (2.0-2.8 s against 3.9 s)"
LAZY = {
    ("autopar.cli", "autopar.bench"): _STARTUP,
    ("autopar.cli", "autopar.calibrate"): _STARTUP,
    ("autopar.cli", "autopar.fit"): _STARTUP,
    ("autopar.cli", "autopar.train"): _STARTUP,
    ("autopar.cli", "autopar.runtime.memory"): _STARTUP,
    ("autopar.cli", "autopar.draw"): "start-up: matplotlib loads only for `autopar show --png`",
}


def floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "entry"


def imports() -> list[tuple[str, str, bool]]:
    """(importer, imported module, inside a function) for every import of autopar's own modules."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        tree = ast.parse(path.read_text())
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{module}: relative import (write it absolute)"
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "autopar" and _exists(target):
                    found.append((module, target, id(node) in nested))
    return found


def _exists(module: str) -> bool:
    rel = PACKAGE.parent.joinpath(*module.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def test_floors_import_only_downward():
    wrong = [f"{a} ({floor(a)}) imports {b} ({floor(b)})" for a, b, _ in imports()
             if floor(b) != floor(a) and floor(b) not in ALLOWED[floor(a)]]
    assert not wrong, "\n".join(wrong)


def test_no_import_hidden_in_a_function():
    hidden = sorted({(a, b) for a, b, inside in imports() if inside} - set(LAZY))
    assert not hidden, "\n".join(f"{a} imports {b} inside a function: import it at the top, "
                                  "or list it in LAZY with its reason" for a, b in hidden)


def test_no_cycles_between_modules():
    import networkx as nx

    graph = nx.DiGraph((a, b) for a, b, inside in imports() if not inside and a != b)
    cycles = [c for c in nx.simple_cycles(graph) if not _package_init_cycle(c)]
    assert not cycles, cycles


def _package_init_cycle(cycle: list[str]) -> bool:
    """A package's `__init__` re-exporting its own modules is not a cycle of dependencies."""
    return len(cycle) == 2 and any(a.startswith(b + ".") for a, b in (cycle, cycle[::-1]))


@pytest.mark.parametrize("module", ["autopar.contract.plan", "autopar.contract.compression",
                                    "autopar.contract.schedules", "autopar.cost_models"])
def test_floor_without_torch(module):
    """The contract's data and the cost models are pure Python: importing them loads no torch."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch loaded'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
