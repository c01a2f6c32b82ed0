"""forward() makes tensors from Python data that follow the batch size (a per-sample count, a
normaliser): constants that differ between captures at two batch sizes, yet are no draw."""
import torch
import torch.nn as nn


class Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        n = x.shape[0]
        scale = torch.tensor([1.0 / n] * n).unsqueeze(1)  # made from Python floats
        return self.fc(x) * scale + torch.tensor(float(n))


def build_model():
    return Normalised()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 8),)
