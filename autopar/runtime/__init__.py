"""Runtime: executes a Plan on torch.distributed. Depends on the Plan alone, never on planner internals."""

from autopar.runtime.backend import default_backend, local_device

__all__ = ["default_backend", "local_device"]
