"""GPT and BERT families at 0.1B to 100B parameters, built on the meta device (never materialised).

The thin model files beside this one (`gpt_4p9b.py`, `bert_100b.py`, ...) each name one size;
bench/compile_scale.py compiles them. Shapes:

- GPT: HF GPT2LMHeadModel, vocabulary 50257, sequence 1024, use_cache=False. 0.1B is GPT-2 small,
  0.35B GPT-2 medium, 1B the GPT-3 XL / "GPT-2 1.3B" shape, 20B GPT-NeoX-20B's width and depth,
  100B a GPT-3-style 80 x 10240 stack. 4.9B is 39 x 3200; 10B 48 x 4096, 40B 60 x 7424 and 60B
  64 x 8960 (heads of 128) fill the ladder between (bench/frontier.py needs its steps).
- BERT: HF BertForPreTraining, vocabulary 30522, sequence 512 (pre-training phase 2). 0.1B is
  BERT-base; 4.9B is the RaNNC paper's enlarged BERT (hidden 2048, intermediate 8192, 96 layers,
  32 heads), 1B the same width at 20 layers, 20B and 100B widen and deepen it; 10B (50 x 4096),
  40B (100 x 5760) and 60B (110 x 6784) fill the ladder between.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int


GPT_SHAPES = {
    "0p1b": Shape(12, 768, 12),
    "0p35b": Shape(24, 1024, 16),
    "1b": Shape(24, 2048, 16),
    "4p9b": Shape(39, 3200, 25),
    "10b": Shape(48, 4096, 32),
    "20b": Shape(44, 6144, 48),
    "40b": Shape(60, 7424, 58),
    "60b": Shape(64, 8960, 70),
    "100b": Shape(80, 10240, 80),
}
BERT_SHAPES = {
    "0p1b": Shape(12, 768, 12),
    "1b": Shape(20, 2048, 32),
    "4p9b": Shape(96, 2048, 32),
    "10b": Shape(50, 4096, 32),
    "20b": Shape(100, 4096, 32),
    "40b": Shape(100, 5760, 45),
    "60b": Shape(110, 6784, 53),
    "100b": Shape(124, 8192, 64),
}
GPT_VOCAB, GPT_SEQ = 50257, 1024
BERT_VOCAB, BERT_SEQ = 30522, 512


def build_gpt(size: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    s = GPT_SHAPES[size]
    config = GPT2Config(vocab_size=GPT_VOCAB, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads,
                        n_positions=GPT_SEQ, use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def gpt_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, GPT_VOCAB, (batch_size, GPT_SEQ)),)


def build_bert(size: str) -> torch.nn.Module:
    from transformers import BertConfig, BertForPreTraining
    s = BERT_SHAPES[size]
    config = BertConfig(vocab_size=BERT_VOCAB, hidden_size=s.hidden, num_hidden_layers=s.layers,
                        num_attention_heads=s.heads, intermediate_size=4 * s.hidden,
                        max_position_embeddings=BERT_SEQ)
    with torch.device("meta"):
        return BertForPreTraining(config)


def bert_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, BERT_VOCAB, (batch_size, BERT_SEQ)),
            "attention_mask": torch.ones(batch_size, BERT_SEQ, dtype=torch.long),
            "token_type_ids": torch.zeros(batch_size, BERT_SEQ, dtype=torch.long)}
