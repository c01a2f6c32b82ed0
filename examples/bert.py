"""HF BertForPreTraining from a small config (random weights, nothing downloaded).

Inputs are keyword arguments (input_ids, attention_mask, token_type_ids). The MLM decoder weight is
tied to the word embeddings.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForPreTraining

VOCAB = 1000
SEQ_LEN = 32


def config() -> BertConfig:
    return BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      intermediate_size=1024, max_position_embeddings=128)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForPreTraining(config())


def _inputs(batch_size: int, gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=gen),
        "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long),
        "token_type_ids": torch.zeros(batch_size, SEQ_LEN, dtype=torch.long),
    }


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return _inputs(batch_size)


def loss_fn(output: Any, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    mlm_labels, nsp_labels = target
    mlm = F.cross_entropy(output.prediction_logits.reshape(-1, VOCAB), mlm_labels.reshape(-1))
    nsp = F.cross_entropy(output.seq_relationship_logits, nsp_labels)
    return mlm + nsp


def batches(batch_size: int) -> Iterator[tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1234)
    while True:
        inputs = _inputs(batch_size, gen)
        mlm = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=gen)
        nsp = torch.randint(0, 2, (batch_size,), generator=gen)
        yield inputs, (mlm, nsp)
