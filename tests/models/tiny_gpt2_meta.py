"""A tiny HF GPT-2 built on the meta device: profiling must materialise it on the target device."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 128


def build_model() -> torch.nn.Module:
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, 16)),)
