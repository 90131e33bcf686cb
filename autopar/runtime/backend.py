"""Backend and device selection: NCCL on CUDA devices, gloo on CPU, chosen from what is present;
and the rendezvous of a job of local ranks, on loopback only."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def same_hash_order() -> None:
    """The ranks this process starts iterate sets in one order (`PYTHONHASHSEED`, unless the caller
    chose one): a model whose forward iterates a set of strings (transformers' ModernBERT does, over
    its layer types) is captured as one graph on every rank, as planning and running need."""
    os.environ.setdefault("PYTHONHASHSEED", "0")


def rank_cores(nproc: int) -> list[int] | None:
    """The core each of `nproc` local ranks is pinned to (`pin`) while it is measured: one of this
    process's allowed cores each, as a GPU rank never shares its device; None where the ranks
    outnumber the cores (they share them, and a time measures the scheduler as well as the plan)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[:nproc] if len(cores) >= nproc else None


def pin(cores: list[int] | None, rank: int) -> None:
    """Run this rank (its process and the threads it starts) on its core of `rank_cores`."""
    if cores is not None:
        os.sched_setaffinity(0, {cores[rank]})


def default_backend() -> str:
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def group_backend(backend: str) -> str:
    """What `init_process_group` gets: NCCL for CUDA tensors with gloo beside it for CPU ones
    (FSDP2's offloaded shards, gathered for a checkpoint or a gradient norm: torchtitan's pairing)."""
    return "cuda:nccl,cpu:gloo" if backend == "nccl" else backend


def local_device(local_rank: int) -> torch.device:
    """The device a rank computes on: its GPU under NCCL, the CPU under gloo."""
    if default_backend() == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), if the system lists one."""
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            if name in ("lo", "lo0"):
                return name
    return None


def keep_to_loopback() -> None:
    """Make gloo and NCCL open their sockets on the loopback interface: left alone they bind the
    address the host name resolves to, which other machines can reach. A value the user set wins."""
    name = loopback_interface()
    if name is not None:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, name)


def _loopback_server(timeout_s: float = 300.0) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on 127.0.0.1 only, on a port bound before anyone learns it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns (and closes) it from here
    try:
        return dist.TCPStore(LOOPBACK, port, None, True, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, multi_tenant=True, master_listen_fd=fd, use_libuv=True), port
    except Exception:
        os.close(fd)
        raise


LOOPBACK_RENDEZVOUS = "autopar-loopback"


def register_loopback_rendezvous() -> str:
    """torch elastic's c10d rendezvous, but the store it opens for the workers (the one
    `MASTER_PORT` names) listens on loopback as well: torch opens it on every address. Returns the
    backend's name for `LaunchConfig.rdzv_backend`."""
    from torch.distributed.elastic.rendezvous import registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    def create(params):
        backend, store = create_backend(params)
        handler = create_handler(store, backend, params)
        if hasattr(handler, "_create_tcp_store_server"):  # torch ≥ 2.5 opens such a store
            handler._create_tcp_store_server = lambda addr, port: _loopback_server()[0]
        handler._backend_name = LOOPBACK_RENDEZVOUS  # the name the registry checks
        return handler

    with contextlib.suppress(ValueError):  # registered already
        registry.handler_registry.register(LOOPBACK_RENDEZVOUS, create)
    return LOOPBACK_RENDEZVOUS


@contextlib.contextmanager
def local_store(timeout_s: float = 300.0) -> Iterator[int]:
    """Serve a rendezvous store from this (the launching) process on loopback and yield its port.

    The socket is bound to 127.0.0.1 before its port is published, so no other process can take
    the port in between (the race of closing a free port and binding it again), and the store
    listens nowhere else: torch's TCPStore binds every address when it opens the port itself.
    Stores opened later in this process on the same port (torch elastic's c10d rendezvous does,
    with `multi_tenant`) share this server."""
    keep_to_loopback()
    store, port = _loopback_server(timeout_s)
    try:
        yield port
    finally:
        del store


def join_local(backend: str, port: int, rank: int, world: int, timeout_s: float | None = None) -> None:
    """`init_process_group` for a rank of a local job whose launcher serves `local_store(port)`."""
    keep_to_loopback()
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else datetime.timedelta(minutes=10)
    store = dist.TCPStore(LOOPBACK, port, world, False, timeout)
    dist.init_process_group(group_backend(backend), store=store, rank=rank, world_size=world, timeout=timeout)
