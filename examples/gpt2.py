"""HF GPT2LMHeadModel from a small config (random weights, use_cache=False).

use_cache=False is required: with the cache on, GPT-2 returns a DynamicCache, which torch.export
cannot capture. lm_head.weight is tied to transformer.wte.weight.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 1000
SEQ_LEN = 32


def config() -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=4, n_head=4, n_positions=128,
                      use_cache=False, bos_token_id=0, eos_token_id=0)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ_LEN)),)


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def batches(batch_size: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    while True:
        seq = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=gen)
        yield (seq[:, :-1],), seq[:, 1:]
