"""A small MLP whose third batch is all padding: every target is cross_entropy's ignore_index,
so that step's mean loss is 0/0 = NaN (a batch of padding only, as a data bug makes it)."""
from typing import Iterator

import torch
from torch import nn

IN, CLASSES = 32, 10


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, CLASSES))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, IN),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target, ignore_index=-100)


def batches(batch_size: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    step = 0
    while True:
        step += 1
        target = torch.randint(0, CLASSES, (batch_size,), generator=gen)
        yield (torch.randn(batch_size, IN, generator=gen),), \
            target if step != 3 else torch.full_like(target, -100)
