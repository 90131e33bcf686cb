"""Models whose export holds higher-order ops: autocast regions, `torch.cond`, nested compile regions."""

from __future__ import annotations

import torch
from torch import nn

import autopar

WIDTH, BATCH = 16, 8


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.mlp(x)
            return x + h.float()
        if self.kind == "cond":
            # on the weights, not the batch: a predicate over the batch would differ between replicas
            return x + torch.cond(self.up.weight.sum() > 0, self.mlp, lambda y: -self.mlp(y), (x,))
        if self.kind == "subgraph":
            return x + _region(self, x)
        return x + self.mlp(x)


@torch.compiler.nested_compile_region
def _region(block: Block, x: torch.Tensor) -> torch.Tensor:
    return block.mlp(x)


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)  # the blocks' input needs a gradient in each: they are alike
        self.blocks = nn.ModuleList(Block(kind) for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def workload(kind: str) -> autopar.Workload:
    def make_batch(batch: int, gen: torch.Generator):
        return (torch.randn(batch, WIDTH, generator=gen),), torch.randint(0, 4, (batch,), generator=gen)
    model = Net(kind)
    return autopar.Workload(name=f"net-{kind}", model=model, example_inputs=make_batch(BATCH, torch.Generator())[0],
                            loss_fn=nn.functional.cross_entropy, make_batch=make_batch, batch=BATCH)
