"""A model file whose build_model() raises a BaseException that is not an Exception."""
import torch


class Stop(BaseException):
    pass


def build_model() -> torch.nn.Module:
    raise Stop("no model today")


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 4),)
