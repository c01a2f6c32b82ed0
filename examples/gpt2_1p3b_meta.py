"""GPT-2 at 1.3B parameters, described on the meta device: never materialised by partc.

24 layers, n_embd 2048, 16 heads, vocab 50257 (the GPT-3 XL / "GPT-2 1.3B" shape). The weights
live on the meta device, so capture costs shapes only (a few hundred MB of RSS, not 5+ GB).
"""
from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 50257
SEQ_LEN = 1024


def config() -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_embd=2048, n_layer=24, n_head=16, n_positions=SEQ_LEN,
                      use_cache=False)


def build_model() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT2LMHeadModel(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ_LEN)),)
