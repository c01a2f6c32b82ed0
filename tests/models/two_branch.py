"""Two parallel branches of different widths joined at the end: a DAG, not a chain. The best cut
can put one branch on each stage, which no cut of a single topological order expresses."""
import torch
from torch import nn


class TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 128)
        self.left = nn.Sequential(*[nn.Sequential(nn.Linear(128, 256), nn.ReLU(),
                                                  nn.Linear(256, 128)) for _ in range(3)])
        self.right = nn.Sequential(*[nn.Sequential(nn.Linear(128, 384), nn.Tanh(),
                                                   nn.Linear(384, 128)) for _ in range(3)])
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.head(torch.cat([self.left(h), self.right(h)], dim=-1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TwoBranch()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 64),)
