"""The docs a user reads first: the site builds without a broken link, and the Python they show runs.

A ```python block in the README or docs/ claims to run as it stands and is executed here; a
fragment that needs context of its own is fenced ```py (highlighted the same, not executed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> dict[str, list[str]]:
    """Each runnable snippet once, with the pages that show it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for code in SNIPPET.findall(page.read_text()):
            found.setdefault(code, []).append(str(page.relative_to(ROOT)))
    return found


SNIPPETS = snippets()


def _run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_site_builds_without_a_broken_link(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    _run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], ROOT)
    assert (tmp_path / "site" / "python-api" / "index.html").exists()


def test_the_readme_shows_a_runnable_training_script():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert any("autopar.parallelize" in code and "README.md" in pages for code, pages in SNIPPETS.items())


@pytest.mark.parametrize("code", list(SNIPPETS), ids=[",".join(p) for p in SNIPPETS.values()])
def test_snippet_runs_as_shown(code, tmp_path):
    """A training script says how it is launched (`torchrun --nproc-per-node N`): it runs so, and its
    losses equal those of the same script in one process, as the docs say."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    one = _run([sys.executable, str(script)], tmp_path)
    launch = re.search(r"torchrun --nproc-per-node (\d+)", code)
    if launch:
        many = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     launch.group(1), str(script)], tmp_path)
        losses = [line for line in one.splitlines() if line.startswith("step ")]
        assert losses and losses == [line for line in many.splitlines() if line.startswith("step ")]


def test_every_command_and_flag_is_documented():
    """Each command has its section in docs/cli.md, and each of its flags a row there."""
    import argparse

    from autopar.cli import _parser

    page = (ROOT / "docs" / "cli.md").read_text()
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in sub.choices.items():
        heading = f"## autopar {name}\n"
        section = page.split(heading)[1].split("\n## ")[0] if heading in page else ""
        flags = [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help", "--json", "--debug")]
        missing += [f"autopar {name} {flag}" for flag in flags if f"`{flag}" not in section]
        missing += [] if section else [heading.strip()]
    assert not missing, f"docs/cli.md does not say: {missing}"
