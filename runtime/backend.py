"""Backend and device selection: NCCL on CUDA devices, gloo on CPU, chosen from what is present."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def default_backend() -> str:
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def local_device(local_rank: int) -> torch.device:
    """The device a rank computes on: its GPU under NCCL, the CPU under gloo."""
    if default_backend() == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port on loopback nothing listens on now, for a job of local ranks to meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
