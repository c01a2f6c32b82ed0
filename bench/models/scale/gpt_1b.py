"""GPT family at size 1b on the meta device (shapes in scale_family.py)."""
import torch
from scale_family import build_gpt, gpt_inputs


def build_model() -> torch.nn.Module:
    return build_gpt("1b")


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return gpt_inputs(batch_size)
