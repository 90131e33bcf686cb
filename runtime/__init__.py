"""Runtime: executes a Plan on torch.distributed. Depends on the Plan alone, never on planner internals."""

from runtime.backend import default_backend, free_port, local_device

__all__ = ["default_backend", "free_port", "local_device"]
