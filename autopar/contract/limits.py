"""Bounds on what a command line, plan or cluster file may ask for: past them the work would run
for hours or exhaust memory before anything could say so (a 10⁶-device mesh, 10⁸ microbatches),
so each is refused at once with one message. Each bound is far above any run we know of."""

from autopar.contract.errors import AutoparError

MAX_DEVICES = 16384  # a mesh or cluster (the largest run in REFERENCES.md: 3072 GPUs)
MAX_DEVICES_PER_HOST = 1024
MAX_BATCH = 2**31  # samples per step
MAX_MICROBATCHES = 65536
MAX_STEPS = 10**9
MAX_SECONDS = 10**7  # a timeout or time limit (about 115 days)
MAX_MEMORY_BYTES = 2**60


def check_counts(nproc: int, steps: int, *others: int) -> None:
    """--nproc and --steps positive, and every count (steps, warm-up, checkpoint interval, delay)
    below `MAX_STEPS`, ranks below `MAX_DEVICES_PER_HOST`."""
    if nproc < 1 or steps < 1:
        raise AutoparError(f"--nproc and --steps must be positive, got {nproc} and {steps}")
    if nproc > MAX_DEVICES_PER_HOST or max(steps, *others) > MAX_STEPS:
        raise AutoparError(f"--nproc must be at most {MAX_DEVICES_PER_HOST} and step counts at most {MAX_STEPS}, "
                           f"got --nproc {nproc} and {max(steps, *others)} steps")
