"""Two "hosts" on this machine: two network namespaces joined by a veth pair, one torchrun agent in
each (`--nnodes 2 --nproc-per-node 2`, a real rendezvous and gloo over TCP between them).

    sudo python benchmarks/two_hosts.py [--json] [--keep-log LOG]

The job plans a 2x2 mesh whose host boundary is the namespaces' (mesh None: the job's hosts ×
local ranks), trains gpt-tiny under a data × tensor layout (data across the hosts) and a tensor ×
pipeline layout (the pipeline across them) and compares every loss with single-process training.
It counts the bytes that crossed the veth pair. Every address lives inside the namespaces it
creates (10.231.0.0/24), nothing leaves the machine, and the namespaces are deleted at the end.
Needs root and `ip netns`; otherwise it says so and exits with status 77 (skipped). Prints its
result lines and writes them to docs/benchmarks/results/two_hosts.md (not with `--json`, whose output
is for programs, nor when skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _page import write
from _stamp import stamp

NAMESPACES, LINKS = ("autopar-host0", "autopar-host1"), ("apveth0", "apveth1")
ADDRESSES, PORT = ("10.231.0.1", "10.231.0.2"), 29731
LAYOUTS, STEPS = ("2,2,1", "1,2,2,2"), 3
SKIPPED = 77


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


def why_not() -> str | None:
    """Why the namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    try:
        _ip("netns", "add", "autopar-probe")
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', exc)}".strip()
    _ip("netns", "del", "autopar-probe")
    return None


def setup() -> None:
    teardown()
    for ns in NAMESPACES:
        _ip("netns", "add", ns)
    _ip("link", "add", LINKS[0], "type", "veth", "peer", "name", LINKS[1])
    for ns, link, address in zip(NAMESPACES, LINKS, ADDRESSES):
        _ip("link", "set", link, "netns", ns)
        _ip("addr", "add", f"{address}/24", "dev", link, namespace=ns)
        _ip("link", "set", link, "up", namespace=ns)
        _ip("link", "set", "lo", "up", namespace=ns)


def teardown() -> None:
    for ns in NAMESPACES:  # deleting a namespace deletes its end of the pair, and so the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _crossed(ns: str, link: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{link}/statistics/tx_bytes"],
                         check=True, capture_output=True, text=True).stdout
    return int(out)


def run(log: Path) -> dict:
    """Both agents, each in its namespace; rank 0 writes the results to `log`."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "AUTOPAR_TWO_HOSTS_LOG": str(log)}
    before = _crossed(NAMESPACES[0], LINKS[0])
    agents = []
    for node, (ns, link) in enumerate(zip(NAMESPACES, LINKS)):
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", ADDRESSES[0],
                   "--master-port", str(PORT), __file__, "--worker"]
        agents.append(subprocess.Popen(command, env={**env, "GLOO_SOCKET_IFNAME": link}, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
    outputs = [a.communicate(timeout=900)[0] for a in agents]
    if any(a.returncode for a in agents):
        raise RuntimeError("a host's agent failed:\n" + "\n".join(o[-3000:] for o in outputs))
    result = json.loads(log.read_text())
    result["bytes_across_hosts"] = _crossed(NAMESPACES[0], LINKS[0]) - before
    return result


def worker() -> None:
    """One rank: the single-process reference, then every layout on the job's 2x2 mesh."""
    import socket

    import torch
    import torch.distributed as dist

    import autopar

    def workload():
        torch.manual_seed(0)
        w = autopar.load_workload("gpt-tiny", batch=8, device="cpu")
        gen = torch.Generator().manual_seed(5)
        return w, [w.make_batch(8, gen) for _ in range(STEPS)]

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    w, batches = workload()
    opt = optimizer(w.model.parameters())
    single = []
    for inputs, target in batches:
        opt.zero_grad()
        loss = w.loss_fn(w.model(*inputs), target)
        loss.backward()
        opt.step()
        single.append(loss.item())
    runs = {}
    for layout in LAYOUTS:
        w, batches = workload()
        pm = autopar.parallelize(w.model, None, w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer, plan=layout)
        runs[layout] = {"losses": [pm.step(*b) for b in batches], "mesh": list(pm.plan.stages[0].submesh)}
    where = [None] * dist.get_world_size()
    dist.all_gather_object(where, {"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]),
                                   "address": os.environ.get("GLOO_SOCKET_IFNAME", "") + " " + _address(),
                                   "hostname": socket.gethostname()})
    if dist.get_rank() == 0:
        worst = max(abs(a - b) / abs(b) for run in runs.values() for a, b in zip(run["losses"], single))
        Path(os.environ["AUTOPAR_TWO_HOSTS_LOG"]).write_text(json.dumps(
            {"single": single, "runs": runs, "ranks": where, "max_rel_diff": worst}, indent=1))
    dist.destroy_process_group()


def _address() -> str:
    """This namespace's address on the pair."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    return out.split()[3] if out.split() else "?"


def _lines(result: dict) -> list[str]:
    """Where each rank ran, every layout's losses beside one process's, and the bytes across the link."""
    return [*(f"rank {r['rank']} (local {r['local_rank']}): {r['address']}" for r in result["ranks"]),
            f"single process: {', '.join(f'{x:.6f}' for x in result['single'])}",
            *(f"{layout}: {', '.join(f'{x:.6f}' for x in run_['losses'])}" for layout, run_ in result["runs"].items()),
            f"largest relative difference: {result['max_rel_diff']:.2e}; "
            f"bytes across the hosts' link: {result['bytes_across_hosts']:,}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    reason = why_not()
    if reason is not None:
        print(f"skipped: {reason}")
        return SKIPPED
    started = stamp()
    setup()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(Path(tmp) / "result.json")
    finally:
        teardown()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        lines = _lines(result)
        print("\n".join(lines))
        write("two_hosts", started, "```text\n" + "\n".join(lines) + "\n```\n")
    return 0 if result["max_rel_diff"] < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
