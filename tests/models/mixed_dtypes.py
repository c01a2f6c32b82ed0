"""A model whose trainable parameters have two dtypes (a float64 scale beside float32 layers):
torch's ZeroRedundancyOptimizer refuses to shard such a parameter set."""
import torch
from torch import nn


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        self.scale = nn.Parameter(torch.ones(64, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale.to(x.dtype)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MixedDtypes()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 64),)
