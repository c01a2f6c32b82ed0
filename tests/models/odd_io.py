"""Awkward inputs and outputs in one model: a no_grad region inside forward (like HF rotary
embeddings), non-tensor keyword arguments (None and an int, specialised by export), a buffer
returned as an output next to the logits, and batch-norm statistics updated in place."""
from __future__ import annotations

import torch
import torch.nn as nn

W = 16


class OddIO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(6))
        self.norm = nn.BatchNorm1d(W)
        self.head = nn.Linear(W, 4)
        self.register_buffer("centers", torch.randn(4, W))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i == 1:
                x = self.norm(x)
            if i == 3:
                with torch.no_grad():
                    s = x.abs().mean(-1, keepdim=True) + 1
                x = x / s
        if mask is not None:
            x = x * mask
        return self.head(x) * repeat, self.centers


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return OddIO()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, W),), {"mask": None, "repeat": 2}


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    logits, centers = output
    return nn.functional.cross_entropy(logits, target) + 0.0 * centers.sum()


def batches(batch_size: int):
    gen = torch.Generator().manual_seed(7)
    while True:
        yield ((torch.randn(batch_size, W, generator=gen),), {"mask": None, "repeat": 2}), \
            torch.randint(0, 4, (batch_size,), generator=gen)
