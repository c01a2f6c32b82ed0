"""A model whose forward calls a custom operator its own file registers (torch.library), as
Hugging Face's MoE layers call `transformers::grouped_mm_fallback`: the stage files call it by
name, so a process must import this file before it can load them."""
import torch
import torch.nn as nn

FEATURES = 16


@torch.library.custom_op("partc_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _backward(ctx, grad):  # type: ignore[no-untyped-def]
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = scaled_tanh(self.a(x), 2.0)
        x = scaled_tanh(self.b(x), 0.5)
        return self.c(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, FEATURES),)
