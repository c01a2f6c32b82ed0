"""Four 32768-wide linear layers built on the meta device: 16 GiB of fp32 weights, 32 GiB with
their gradients, more than the test machines' memory, so `partc profile` must refuse to measure
it whole rather than materialise it (tests/plans/test_measurable_sizes.py)."""
import torch

WIDTH = 32768


def build_model() -> torch.nn.Module:
    with torch.device("meta"):
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, WIDTH),)
