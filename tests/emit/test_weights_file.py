"""Weights files as users have them (`--init-from`): safetensors, a sharded checkpoint's index,
a training checkpoint dict, a state dict saved through a wrapper (DDP, torch.compile, a Hugging
Face head); each read as the model names its tensors, or refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from partc.emit.weights_file import WeightsError, for_model, read_weights_file


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _same(loaded: object, state: dict[str, torch.Tensor]) -> None:
    assert isinstance(loaded, dict) or hasattr(loaded, "__getitem__")
    assert sorted(loaded) == sorted(state)  # type: ignore[call-overload]
    assert all(torch.equal(loaded[k], v) for k, v in state.items())  # type: ignore[index]


def test_a_safetensors_file_is_read_by_its_content(tmp_path: Path) -> None:
    state = _model().state_dict()
    path = tmp_path / "weights.bin"  # the name says nothing: the first bytes do
    save_file(state, path)
    _same(read_weights_file(path), state)


@pytest.mark.parametrize("shard_format", ["safetensors", "torch"])
def test_a_sharded_checkpoint_index_reads_each_tensor_from_its_shard(
        tmp_path: Path, shard_format: str) -> None:
    state = _model().state_dict()
    names = sorted(state)
    shards = {f"part-{i}": {n: state[n].clone() for n in names[i::2]} for i in range(2)}
    weight_map = {}
    for shard, tensors in shards.items():
        if shard_format == "safetensors":
            save_file(tensors, tmp_path / shard)
        else:
            torch.save(tensors, tmp_path / shard)
        weight_map.update({n: shard for n in tensors})
    index = tmp_path / "model.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _same(read_weights_file(index), state)
    # a Hugging Face cache: the snapshot's files are links into blobs/
    snapshot, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    snapshot.mkdir()
    blobs.mkdir()
    for shard in shards:
        (tmp_path / shard).rename(blobs / shard)
        (snapshot / shard).symlink_to(blobs / shard)
    (snapshot / index.name).symlink_to(index)
    _same(read_weights_file(snapshot / index.name), state)
    (snapshot / "part-1").unlink()
    index = snapshot / index.name
    with pytest.raises(WeightsError, match="names shard part-1, which is not a file"):
        read_weights_file(index)


def test_an_index_cannot_point_outside_its_directory(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"\x80 not yours")
    (tmp_path / "ckpt").mkdir()
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"0.weight": "../secret"}}))
    with pytest.raises(WeightsError, match="outside its own directory"):
        read_weights_file(index)
    index.write_text(json.dumps({"format": "not an index"}))
    with pytest.raises(WeightsError, match="no checkpoint index"):
        read_weights_file(index)


def test_a_truncated_safetensors_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(_model().state_dict(), path)
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(WeightsError, match="cannot open safetensors file"):
        read_weights_file(path)
    path.write_bytes(data[:60])  # cut inside the header itself
    with pytest.raises(WeightsError, match=r"header runs past the file's end \(60 bytes\)"):
        read_weights_file(path)


def test_a_training_checkpoint_dict_gives_its_model_state(tmp_path: Path) -> None:
    """torch.save({'epoch': ..., 'model_state_dict': ..., 'optimizer_state_dict': ...}), the
    PyTorch tutorials' checkpoint; a dict with no state dict in it names its keys."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "ckpt.pt"
    torch.save({"epoch": 3, "model_state_dict": model.state_dict(),
                "optimizer_state_dict": optimizer.state_dict()}, path)
    _same(read_weights_file(path), model.state_dict())
    torch.save({"epoch": 3, "optimizer_state_dict": optimizer.state_dict()}, path)
    with pytest.raises(WeightsError, match=r"not a state dict of tensors \(its keys: epoch, "
                                           r"optimizer_state_dict\)"):
        read_weights_file(path)


@pytest.mark.parametrize(("wrap", "prefix", "source"), [
    (torch.nn.DataParallel, "module.", "DataParallel/DistributedDataParallel"),
    (torch.compile, "_orig_mod.", "torch.compile"),
])
def test_a_wrappers_prefix_is_read_away_and_said(wrap: object, prefix: str, source: str) -> None:
    model = _model()
    state = wrap(model).state_dict()  # type: ignore[operator]
    assert all(k.startswith(prefix) for k in state)
    weights = for_model(state, model.state_dict(), {}, "w.pt")
    assert weights.prefix == prefix
    _same(dict(weights.state.items()), model.state_dict())
    assert weights.note("w.pt") == (f"w.pt stores the model's tensors under the prefix "
                                    f"{prefix!r} (a {source} wrapper's); read without it")
    direct = for_model(model.state_dict(), model.state_dict(), {}, "w.pt")
    assert direct.prefix == "" and direct.note("w.pt") is None


def test_a_heads_checkpoint_gives_the_base_models_tensors() -> None:
    """A Hugging Face ...ForCausalLM checkpoint ('model.layers.0...', 'lm_head.weight') for a
    plan of the base model ('layers.0...'): the head's extra tensors are never read."""
    base = _model()
    head = torch.nn.ModuleDict({"model": base, "lm_head": torch.nn.Linear(2, 5)})
    weights = for_model(head.state_dict(), base.state_dict(), {}, "w.pt")
    assert weights.prefix == "model."
    assert sorted(weights.state) == sorted(base.state_dict())


def test_two_prefixes_that_both_fit_are_refused_not_guessed() -> None:
    base = _model()
    twins = torch.nn.ModuleDict({"encoder": base, "decoder": _model()})
    with pytest.raises(WeightsError, match=r"under 2 prefixes \('decoder\.', 'encoder\.'\)"):
        for_model(twins.state_dict(), base.state_dict(), {}, "w.pt")


def test_a_prefix_that_finds_most_names_is_read_away_and_the_rest_left_to_name() -> None:
    """One tensor missing from a DDP-saved file: the prefix is still read away, so the caller's
    refusal names the one missing tensor, not all of them; a file of another model keeps its
    names."""
    base = _model()
    partial = {"module." + k: v for k, v in base.state_dict().items() if k != "2.bias"}
    weights = for_model(partial, base.state_dict(), {}, "w.pt")
    assert weights.prefix == "module." and "2.weight" in weights.state
    assert "2.bias" not in weights.state
    other = {"module.fc.weight": torch.zeros(1)}
    assert for_model(other, base.state_dict(), {}, "w.pt").prefix == ""
