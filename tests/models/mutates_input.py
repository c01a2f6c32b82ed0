"""forward() scales its input in place (`x.mul_(2)`), as eager code may: verify must give the
whole model and the stages each their own copy, and the first stage's inputs no gradient (a
leaf that requires grad cannot be changed in place)."""
import torch
import torch.nn as nn


class ScalesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.head(self.layers(x))


def build_model():
    torch.manual_seed(0)
    return ScalesInput()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 16),)
