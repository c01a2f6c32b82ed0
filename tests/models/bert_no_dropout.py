"""examples/bert.py with dropout off (see gpt2_no_dropout.py): keyword inputs, a (MLM, NSP)
target pair and a tied decoder."""
from __future__ import annotations

import torch
from _examples import example

_example = example("bert")

example_inputs = _example.example_inputs
loss_fn = _example.loss_fn
batches = _example.batches


def build_model() -> torch.nn.Module:
    config = _example.config()
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    return _example.BertForPreTraining(config)
