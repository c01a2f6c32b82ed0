"""forward() draws a mask with numpy (as HF wav2vec2's SpecAugment does): torch.export records the
one draw as a constant, which a plan would apply at every step."""
import numpy as np
import torch
import torch.nn as nn


class NumpyMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            keep = torch.tensor(np.random.rand(*h.shape) > 0.5)
            h = h * keep
        return h


def build_model():
    return NumpyMasked()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 8),)
