"""heavy_weights' four linear layers 32768 wide, built on the meta device: 16 GiB of fp32
weights, 32 GiB with their gradients, more than the test machines' memory, so `partc profile`
must refuse to measure it whole rather than materialise it
(tests/plans/test_measurable_sizes.py)."""
import torch
from heavy_weights import linear_stack

WIDTH = 32768


def build_model() -> torch.nn.Module:
    with torch.device("meta"):
        return linear_stack(WIDTH)


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, WIDTH),)
