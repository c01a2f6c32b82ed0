"""A model with a data-dependent shape: boolean-mask indexing keeps the rows whose sum is > 0."""
import torch
import torch.nn as nn


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h[h.sum(-1) > 0]
        return self.out(h)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Masked()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 8),)
