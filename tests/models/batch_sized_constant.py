"""forward() makes tensors and numbers from Python data that follow the batch size (a per-sample
count, a normaliser): constants and literals that differ between captures at two batch sizes,
yet are no draw."""
import torch
import torch.nn as nn


class Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        n = x.shape[0]
        scale = torch.tensor([1.0 / n] * n).unsqueeze(1)  # made from Python floats
        # (n - 1) / n: a literal that changes between B and 2B by other than 2x
        return self.fc(x) * scale + torch.tensor(float(n)) + (n - 1) / n


def build_model():
    return Normalised()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 8),)
