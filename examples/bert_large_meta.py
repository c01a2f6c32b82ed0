"""HF BERT-large (BertForPreTraining: 24 layers, hidden 1024, 16 heads, 336M parameters), described
on the meta device: never materialised by partc. Sequence length 512, the BERT pre-training
phase-2 length.
"""
from __future__ import annotations

import torch
from transformers import BertConfig, BertForPreTraining

VOCAB = 30522
SEQ_LEN = 512


def config() -> BertConfig:
    return BertConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24,
                      num_attention_heads=16, intermediate_size=4096,
                      max_position_embeddings=SEQ_LEN)


def build_model() -> torch.nn.Module:
    with torch.device("meta"):
        return BertForPreTraining(config())


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, VOCAB, (batch_size, SEQ_LEN)),
        "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long),
        "token_type_ids": torch.zeros(batch_size, SEQ_LEN, dtype=torch.long),
    }
