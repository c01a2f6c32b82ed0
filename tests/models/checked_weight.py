"""Layers whose norms compute with `weight.float()` (as HF Gemma's and Llama's RMSNorm do):
export checks each such weight's dtype with a node of its own (`_assert_tensor_metadata`),
which reads the weight and feeds nothing, so nothing ties it to the stage of the weight's user."""
import torch
import torch.nn as nn


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = Norm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(*[Layer(64) for _ in range(6)])


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 64),)
