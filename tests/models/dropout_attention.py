"""examples/transformer.py with dropout on the attention probabilities (as HF BERT and GPT-2 have
it): a CPU then runs scaled_dot_product_attention's math path, which keeps scaled copies of the
query and key, the probabilities, the dropout mask and the dropped probabilities, and reads its
query, key and value without keeping them."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from _examples import example, transformer_with_attention

_example = example("transformer")

example_inputs = _example.example_inputs
loss_fn = _example.loss_fn
batches = _example.batches
ATTENTION_DROPOUT = 0.1


class DropoutAttention(_example.Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        p = ATTENTION_DROPOUT if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


def build_model() -> nn.Module:
    return transformer_with_attention(_example, DropoutAttention)
