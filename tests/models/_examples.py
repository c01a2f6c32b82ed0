"""Import one of examples/*.py as a module, for test model files that vary an example."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"partc_example_{name}", Path(__file__).resolve().parents[2] / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
