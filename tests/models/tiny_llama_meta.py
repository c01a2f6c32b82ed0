"""A tiny HF Llama built on the meta device. Its RoPE `inv_freq` buffer is computed at build time
(so on meta it has no values): profiling must materialise it the way launch does."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128


def build_model() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, 16)),)
