"""Cost models shared by the planner passes, the simulator and `autopar compare`: pure functions
of sizes and a `ClusterSpec`, reading `autopar.contract` only and loading no torch."""

from autopar.cost_models.cluster import ClusterSpec, DeviceSpec, Link
from autopar.cost_models.comm import Collective, axis_link, collective_time, p2p_link, p2p_time
from autopar.cost_models.compute import compute_time, fixed_time, optimizer_time
from autopar.cost_models.memory import (
    MemoryBreakdown,
    fits,
    model_state_memory,
    training_memory,
)
from autopar.cost_models.presets import PRESETS, calibration_file, get_cluster

__all__ = [
    "PRESETS",
    "ClusterSpec",
    "Collective",
    "DeviceSpec",
    "Link",
    "MemoryBreakdown",
    "axis_link",
    "calibration_file",
    "collective_time",
    "compute_time",
    "fits",
    "fixed_time",
    "optimizer_time",
    "get_cluster",
    "model_state_memory",
    "p2p_link",
    "p2p_time",
    "training_memory",
]
