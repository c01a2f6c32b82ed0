"""Many parallel branches of uneven widths joined at the end: a block DAG with many ways to cut,
on which CP-SAT keeps searching for a while (tests/test_bad_inputs_signals.py interrupts it)."""
import torch
from torch import nn

BRANCHES = 24
# uneven, fixed widths: 3 hidden layers per branch
WIDTHS = [tuple(32 + (b * 53 + k * 97) % 224 for k in range(3)) for b in range(BRANCHES)]
IN = 256


class Branch(nn.Module):
    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        dims = [IN, *widths, IN]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


class WideDag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(Branch(w) for w in WIDTHS[:BRANCHES])
        self.head = nn.Linear(IN, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for branch in self.branches:
            out = out + branch(x)
        return self.head(out)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return WideDag()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, IN),)
