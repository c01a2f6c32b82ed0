"""BERT-base (HF BertForPreTraining, the published bert-base-uncased shape: 12 layers, hidden 768,
12 heads, vocabulary 30522; 110M parameters) with random weights, at sequence length 128. Used by
bench/check.py; nothing is downloaded."""
from __future__ import annotations

import torch
from transformers import BertConfig, BertForPreTraining

SEQ_LEN = 128


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig())  # BertConfig()'s defaults are bert-base-uncased's


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    vocab = BertConfig().vocab_size
    return {"input_ids": torch.randint(0, vocab, (batch_size, SEQ_LEN),
                                       generator=torch.Generator().manual_seed(0)),
            "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long),
            "token_type_ids": torch.zeros(batch_size, SEQ_LEN, dtype=torch.long)}
