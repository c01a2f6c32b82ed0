"""Four wide linear layers: the weights are nearly all of the model's memory, so on a device
with room for half of them and their gradients, two stages fit where the whole model does not
(tests/plans/test_measurable_sizes.py)."""
import torch

WIDTH = 1024


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, WIDTH),)
