"""A meta-device model whose forward counts integers with `torch.histc`, as HF Mixtral's router
does on meta: capture works (meta kernels take any dtype), but the CPU has no integer histc
kernel, so the captured program cannot be measured (or run) on the CPU."""
import torch
import torch.nn as nn

FEATURES = 8


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(FEATURES, 4)
        self.out = nn.Linear(FEATURES, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.histc(self.gate(x).argmax(-1).int(), bins=4, min=0, max=3)
        return self.out(x) * counts.float().clamp(min=1).reciprocal()


def build_model() -> nn.Module:
    with torch.device("meta"):
        return Router()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, FEATURES),)
