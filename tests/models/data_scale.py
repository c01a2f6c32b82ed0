"""A model whose forward takes a non-tensor `scale` (export bakes its value into the program):
example_inputs passes 2.0, and batches() passes $PARTC_TEST_DATA_SCALE (default 2.0), as data
read from elsewhere might (the model file itself is hashed into the plan and cannot change)."""
import os
from typing import Iterator

import torch
import torch.nn as nn


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.head(self.layers(x) * scale)


def build_model():
    torch.manual_seed(0)
    return Scaled()


def example_inputs(batch_size: int):
    return ((torch.randn(batch_size, 16),), {"scale": 2.0})


def batches(batch_size: int) -> Iterator[tuple[object, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    scale = float(os.environ.get("PARTC_TEST_DATA_SCALE", "2.0"))
    while True:
        yield ((torch.randn(batch_size, 16, generator=gen),), {"scale": scale}), \
            torch.randint(0, 4, (batch_size,), generator=gen)
