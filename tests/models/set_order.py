"""A model whose forward iterates over a set of strings, as HF ModernBERT's RoPE iterates over its
layer types: the captured graph depends on the process's str hash seed."""
import torch
import torch.nn as nn

NAMES = {"alpha", "beta", "gamma", "delta"}


class Scales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        for i, name in enumerate(sorted(NAMES)):
            self.register_buffer(name, torch.full((4,), float(i + 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        for name in NAMES:
            x = torch.tanh(x) * getattr(self, name)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Scales()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 4),)
