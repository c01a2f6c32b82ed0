"""Import one of examples/*.py as a module, for test model files that vary an example."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"partc_example_{name}", Path(__file__).resolve().parents[2] / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def transformer_with_attention(transformer: ModuleType, attention: type) -> Any:
    """examples/transformer.py's TinyLM (seeded as its build_model) with every block's attention
    an `attention(d_model, heads)`: the test models that vary only the attention."""
    import torch

    torch.manual_seed(0)
    model = transformer.TinyLM()
    for block in model.blocks:
        block.attn = attention(transformer.D_MODEL, transformer.HEADS)
    return model
