"""A tiny HF Swin built on the meta device: its relative_position_index buffers are computed at
build time (meta here, so values only once launch initialises them) and its shifted-window
attention mask is created in forward on the input's device (meta when captured)."""
import torch
from transformers import SwinConfig, SwinForImageClassification


def build_model() -> torch.nn.Module:
    with torch.device("meta"):
        return SwinForImageClassification(SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[1, 2],
            window_size=2, num_labels=10))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, 32, 32),)
