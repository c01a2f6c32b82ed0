"""forward() scales by a Python draw (a hand-rolled stochastic depth): torch.export records the
one number drawn while capturing as a literal of the multiplication, which a plan would apply
at every step."""
import random

import torch
import torch.nn as nn


class RandomlyScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = h * random.uniform(0.5, 1.5)
        return h


def build_model():
    return RandomlyScaled()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 8),)
