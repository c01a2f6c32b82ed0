import torch


def build_model():
    return "a model"


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 4),)
