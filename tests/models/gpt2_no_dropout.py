"""examples/gpt2.py with dropout off: its pipeline-parallel training must equal single-process
training step for step (dropout masks depend on how the batch is split, so they cannot)."""
from __future__ import annotations

import torch
from _examples import example

_example = example("gpt2")

example_inputs = _example.example_inputs
loss_fn = _example.loss_fn
batches = _example.batches


def build_model() -> torch.nn.Module:
    config = _example.config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    return _example.GPT2LMHeadModel(config)
