"""A small CNN with batch norm (the ResNet example's layers at 8x8 images and 8 channels): for
tests of what training-mode forwards do to buffers, at a fraction of the ResNet's cost."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

CLASSES, IMAGE, WIDTH = 4, 8, 8


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU(),
        nn.Conv2d(WIDTH, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTH, CLASSES))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, IMAGE, IMAGE),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def batches(batch_size: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    while True:
        yield ((torch.randn(batch_size, 3, IMAGE, IMAGE, generator=gen),),
               torch.randint(0, CLASSES, (batch_size,), generator=gen))
