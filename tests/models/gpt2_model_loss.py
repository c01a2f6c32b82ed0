"""The Hugging Face training habit: labels go into the model, which returns its own loss
(`output.loss`), and batches yield no separate target. GPT-2 from examples/gpt2.py's small
config, dropout off (pipeline training must equal single-process training step for step)."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from _examples import example

_example = example("gpt2")
VOCAB, SEQ_LEN = _example.VOCAB, _example.SEQ_LEN


def build_model() -> torch.nn.Module:
    config = _example.config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    return _example.GPT2LMHeadModel(config)


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids}


def loss_fn(output: Any, target: Any) -> torch.Tensor:
    return output.loss


def batches(batch_size: int) -> Iterator[tuple[dict[str, torch.Tensor], None]]:
    gen = torch.Generator().manual_seed(1234)
    while True:
        ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=gen)
        yield {"input_ids": ids, "labels": ids}, None
