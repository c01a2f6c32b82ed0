"""BERT family at size 0p1b on the meta device (shapes in scale_family.py)."""
from scale_family import bert_inputs, build_bert


def build_model():
    return build_bert("0p1b")


def example_inputs(batch_size: int):
    return bert_inputs(batch_size)
