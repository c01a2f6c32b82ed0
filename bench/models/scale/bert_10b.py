"""BERT family at size 10b on the meta device (shapes in scale_family.py)."""
import torch
from scale_family import bert_inputs, build_bert


def build_model() -> torch.nn.Module:
    return build_bert("10b")


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return bert_inputs(batch_size)
