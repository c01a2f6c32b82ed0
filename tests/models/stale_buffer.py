"""A buffer read by the first layers and updated in place after the last (an EMA): a cut between
them would leave two stages with diverging copies, which compile refuses."""
import torch
import torch.nn as nn

W = 32
D = 8

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(W))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(D))
        self.head = nn.Linear(W, 10)

    def forward(self, x):
        h = x * self.scale
        for layer in self.layers:
            h = torch.relu(layer(h))
        self.scale.mul_(0.9).add_(0.1 * h.detach().mean(0))
        self.steps.add_(1)
        return self.head(h)

def build_model():
    torch.manual_seed(0)
    return M()

def example_inputs(b):
    return (torch.randn(b, W),)
