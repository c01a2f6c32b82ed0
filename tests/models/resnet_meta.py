"""examples/resnet.py built on the meta device (no weights materialised)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import resnet  # noqa: E402


def build_model() -> torch.nn.Module:
    with torch.device("meta"):
        return resnet.ResNet()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return resnet.example_inputs(batch_size)
