"""examples/mlp.py's model, whose example_inputs refuses batch size 1: captured at 2 and 4 and
solved as usual, a plan with micro-batches of 1 fails in emit, after the solve (a compile that
fails late must leave the previous plan as it was: tests/test_bad_inputs_signals.py)."""
import torch
from torch import nn

IN = 64


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    if batch_size == 1:
        raise ValueError("this test model has no inputs of batch size 1")
    return (torch.randn(batch_size, IN),)
