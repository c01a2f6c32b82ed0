"""HF GPT-2 with its default use_cache=True: returns a DynamicCache, which torch.export rejects."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2,
                                      n_positions=16, bos_token_id=0, eos_token_id=0))


def example_inputs(batch_size: int):
    return (torch.randint(0, 100, (batch_size, 8)),)
