"""Two hosts for real: torchrun agents in two network namespaces joined by a veth pair, a 2x2 mesh
whose host boundary is theirs, losses equal to one process (benchmarks/two_hosts.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "two_hosts.py"


def test_a_job_across_two_hosts_trains_like_one_process():
    done = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=900)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    addresses = {r["rank"]: r["address"].split()[-1] for r in result["ranks"]}
    assert addresses[0] == addresses[1] != addresses[2] == addresses[3]  # two ranks on each host
    for run in result["runs"].values():
        assert run["losses"] == pytest.approx(result["single"], rel=1e-5)
    assert result["bytes_across_hosts"] > 100_000  # the data axis (and the pipeline) crossed the link
