"""A model file that prints thousands of lines while importing and building (a chatty model)."""
import torch

for i in range(3000):
    print(f"importing layer table row {i}")


def build_model() -> torch.nn.Module:
    for i in range(3000):
        print(f"building layer {i}")
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 4),)
