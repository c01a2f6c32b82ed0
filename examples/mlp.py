"""A small multi-layer perceptron: the simplest partc model file.

Contract (docs/model-files.md): build_model(), example_inputs(batch_size), and optionally
loss_fn(output, target) and batches(batch_size).
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

IN_FEATURES = 64
HIDDEN = 256
CLASSES = 10
LAYERS = 6


class MLP(nn.Module):
    def __init__(self, d_in: int = IN_FEATURES, hidden: int = HIDDEN, classes: int = CLASSES,
                 layers: int = LAYERS) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.act = nn.ReLU()
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.act(layer(x))
        return self.head(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, IN_FEATURES),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def batches(batch_size: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    while True:
        x = torch.randn(batch_size, IN_FEATURES, generator=gen)
        y = torch.randint(0, CLASSES, (batch_size,), generator=gen)
        yield (x,), y
