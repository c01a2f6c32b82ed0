"""A model file whose build_model() calls sys.exit(0): partc must not report success."""
import sys

import torch


def build_model() -> torch.nn.Module:
    sys.exit(0)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 4),)
