"""Backend selection: NCCL only where CUDA is present, gloo and the CPU otherwise."""

import torch

from autopar.runtime import default_backend, local_device


def test_backend_follows_the_hardware():
    if torch.cuda.is_available():
        assert default_backend() == "nccl" and local_device(0).type == "cuda"
    else:
        assert default_backend() == "gloo" and local_device(3) == torch.device("cpu")
