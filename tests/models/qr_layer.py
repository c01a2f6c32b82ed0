"""Passes torch.export but not torch.onnx: linalg.qr has no ONNX conversion in torch 2.13."""
import torch
import torch.nn as nn


class Orthogonalize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, _ = torch.linalg.qr(self.proj(x).view(-1, 4, 4))  # orthonormalise 4x4 blocks
        return self.head(q.reshape(x.shape[0], 16))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Orthogonalize()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 16),)
