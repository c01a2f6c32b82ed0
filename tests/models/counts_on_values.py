"""A model with an op meta tensors cannot run: it scales by a count read from its input's values
(`.item()`), which torch.export captures as an unbacked integer. partc counts its saved
activations where the model lives instead of on meta copies."""
import torch
from torch import nn


class CountsOnValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = (x > 0).sum().item()
        torch._check(k >= 0)
        return self.second(torch.relu(self.first(x)) * k)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return CountsOnValues()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 16),)
