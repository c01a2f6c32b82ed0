"""forward() rolls the sequence by a Python draw (a hand-rolled random shift): the shift is an
integer literal of the captured program, one shift for every step of a plan."""
import random

import torch
import torch.nn as nn


class RandomlyRolled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.roll(x, shifts=random.randrange(1_000_000_000), dims=1)
        return self.fc(h).mean(1)


def build_model():
    return RandomlyRolled()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 16, 8),)
