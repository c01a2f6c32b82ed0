"""Four wide linear layers: the weights are nearly all of the model's memory, so on a device
with room for half of them and their gradients, two stages fit where the whole model does not
(tests/plans/test_measurable_sizes.py)."""
import torch

WIDTH = 1024


def linear_stack(width: int) -> torch.nn.Module:
    """Four width x width linear layers with ReLUs (tests/models/huge_meta.py builds it wider)."""
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return linear_stack(WIDTH)


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, WIDTH),)
