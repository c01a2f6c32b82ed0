"""Hugging Face ResNetForImageClassification from a small config, built on the meta device
(convolutions, batch norm, pooling: a CNN whose weights are never materialised at compile)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import ResNetConfig, ResNetForImageClassification

CLASSES = 10
IMAGE = 32


def build_model() -> torch.nn.Module:
    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64],
                          depths=[1, 1, 1], layer_type="basic", num_labels=CLASSES)
    with torch.device("meta"):
        return ResNetForImageClassification(config)


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE)}


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, target)
