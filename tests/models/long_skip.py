"""A chain of linear layers with a long skip: the first layer's output is added to the last one's,
so any cut into 3+ stages relays it through the stages in between."""
from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 64
DEPTH = 6


class LongSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.tanh(self.first(x))
        h = skip
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h + skip)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LongSkip()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, WIDTH),)
