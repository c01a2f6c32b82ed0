"""examples/transformer.py with the attention's query, key and value as three projections (as HF
BERT and Llama have them) and no dropout, so a pipeline can be cut between them and a CPU runs
its flash attention kernel: a stage that receives the query hands that buffer itself to the
kernel, which keeps it for backward."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from _examples import example, transformer_with_attention

_example = example("transformer")

example_inputs = _example.example_inputs
loss_fn = _example.loss_fn
batches = _example.batches


class SplitAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


def build_model() -> nn.Module:
    return transformer_with_attention(_example, SplitAttention)
