"""The runtime benchmark's model: a stack of 8 equal 1024-wide blocks (Linear + GELU), big enough
per micro-batch that one CPU thread computes far longer than a gloo send takes, so a 2-stage
pipeline is compute-bound as on real accelerators. Synthetic regression data."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

WIDTH = 1024
BLOCKS = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class MLPStack(nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MLPStack()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, WIDTH),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batches(batch_size: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    while True:
        yield (torch.randn(batch_size, WIDTH, generator=gen),), torch.randn(batch_size, WIDTH,
                                                                            generator=gen)
