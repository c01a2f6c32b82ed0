"""Some parameters on meta, some real: captured whole on meta, never materialised."""
import torch
import torch.nn as nn


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(8, 8)
        with torch.device("meta"):
            self.big = nn.Linear(8, 4096)

    def forward(self, x):
        return self.big(self.small(x))


def build_model():
    return Mixed()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 8),)
