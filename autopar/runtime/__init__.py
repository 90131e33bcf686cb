"""Runtime: executes a Plan on torch.distributed. Reads `autopar.contract` only, never the planner
(`tests/test_architecture.py` checks it)."""

from autopar.runtime.backend import default_backend, local_device

__all__ = ["default_backend", "local_device"]
