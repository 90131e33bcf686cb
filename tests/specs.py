"""A model spec importable as `tests.specs:tiny_mlp`, returning the optional loss and data too."""

import torch
import torch.nn.functional as F


def tiny_mlp():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def make_batch(batch, gen):
        return (torch.randn(batch, 8, generator=gen),), torch.randint(0, 3, (batch,), generator=gen)

    return model, (torch.zeros(4, 8),), F.cross_entropy, make_batch
