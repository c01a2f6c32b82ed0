"""GPT family at size 4p9b on the meta device (shapes in scale_family.py)."""
import torch
from scale_family import build_gpt, gpt_inputs


def build_model() -> torch.nn.Module:
    return build_gpt("4p9b")


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return gpt_inputs(batch_size)
