"""Weights a user hands partc (`--init-from`): what torch.save can write is read, dtypes are
fitted as torch's load_state_dict fits them, and anything else is one line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partc.emit.stage_weights import WeightsError, fit_to_stage
from partc.emit.weights_file import read_weights_file


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).state_dict()


def test_legacy_and_zip_torch_save_files_load_alike(tmp_path: Path) -> None:
    """The legacy format (torch < 1.6, or asked for) cannot be memory-mapped; it was refused
    with torch's 'mmap can only be used with files saved with ...'."""
    state = _state()
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("zip.pt", "legacy.pt"):
        loaded = read_weights_file(tmp_path / name)
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("content", [b"hello, weights", b""], ids=["text", "empty"])
def test_a_file_torch_save_never_writes_is_named_as_such(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "w.pt"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match="is not a file torch.save writes"):
        read_weights_file(path)


def test_floating_weights_are_cast_to_the_stages_dtype_and_other_data_refused() -> None:
    """A bf16-saved checkpoint into an fp32 plan is cast, as load_state_dict copies; integers
    for floats, or another shape, are another model's tensors."""
    stage = torch.nn.Linear(4, 3)
    state = _state()
    fitted = fit_to_stage(stage, {k: v.bfloat16() for k, v in state.items()}, "w.pt")
    assert all(v.dtype == torch.float32 for v in fitted.values())
    assert torch.equal(fitted["weight"], state["weight"].bfloat16().float())
    with pytest.raises(WeightsError, match=r"w.pt: weight is \(3, 4\) torch.int32, the stage"):
        fit_to_stage(stage, {"weight": state["weight"].int()}, "w.pt")
    with pytest.raises(WeightsError, match=r"weight is \(3, 5\) torch.float32"):
        fit_to_stage(stage, {"weight": torch.zeros(3, 5)}, "w.pt")
