"""A tiny HF Mixtral (mixture of experts, random weights): under torch.export in fp32 its experts
run transformers' `transformers::grouped_mm_fallback` operator, which torch's FLOP counter does
not know."""
import torch
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB = 128
SEQ = 16
HIDDEN = 32
INTERMEDIATE = 64
LAYERS = 2
EXPERTS = 4
TOP_K = 2


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=64,
        use_cache=False))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)
