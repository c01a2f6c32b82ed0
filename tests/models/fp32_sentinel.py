"""Attention whose masked scores are filled with float32's most negative value, as Hugging Face
models compute `torch.finfo(scores.dtype).min` (DeBERTa-v2): captured in float32 the sentinel
is -3.4028e38, which a bfloat16 tensor cannot hold."""
import torch
import torch.nn as nn

D, SEQ = 16, 8


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        keep = torch.ones(SEQ, SEQ, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        return self.out(scores.softmax(-1) @ x).mean(1)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Masked()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, SEQ, D),)
