"""forward() branches on a tensor's value: not capturable by torch.export."""
import torch
import torch.nn as nn


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return y * 2
        return y


def build_model():
    return Branchy()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 4),)
