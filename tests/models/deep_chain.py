"""A deep MLP with uneven layer widths: its block graph is a chain, so the exact chain DP and
CP-SAT must agree on every shape."""
import torch
from torch import nn

WIDTHS = [48, 160, 96, 224, 64, 192, 128, 256, 80, 176, 112, 32]


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:], strict=False):  # consecutive pairs: one shorter
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, WIDTHS[0]),)
