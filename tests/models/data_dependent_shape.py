"""A Hugging Face BERT encoder (small config) whose head keeps only the token vectors with a
positive sum: boolean-mask indexing, a size that depends on the data. torch.export captures it
(with an unbacked size); partc must refuse it in one line naming the operator and this line."""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

VOCAB, SEQ_LEN = 1000, 16


class KeepPositive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128))
        self.head = nn.Linear(64, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids).last_hidden_state
        kept = h[h.sum(-1) > 0]
        return self.head(kept)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return KeepPositive()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ_LEN)),)
