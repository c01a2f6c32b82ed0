"""GPT family at size 10b on the meta device (shapes in scale_family.py)."""
from scale_family import build_gpt, gpt_inputs


def build_model():
    return build_gpt("10b")


def example_inputs(batch_size: int):
    return gpt_inputs(batch_size)
