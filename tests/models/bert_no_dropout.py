"""examples/bert.py with dropout off (see gpt2_no_dropout.py): keyword inputs, a (MLM, NSP)
target pair and a tied decoder."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "partc_example_bert", Path(__file__).resolve().parents[2] / "examples" / "bert.py")
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

example_inputs = _example.example_inputs
loss_fn = _example.loss_fn
batches = _example.batches


def build_model() -> torch.nn.Module:
    config = _example.config()
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    return _example.BertForPreTraining(config)
