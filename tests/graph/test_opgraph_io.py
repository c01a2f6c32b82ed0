"""OpGraph files round-trip exactly; the content hash is stable and changes when the model does."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import EXAMPLES

from partc.errors import GraphFileError
from partc.frontend.capture import capture_graph
from partc.graph.opgraph import OpGraph


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_round_trip_is_exact(capture_example, tmp_path: Path, suffix: str) -> None:
    graph = capture_example("bert").graph
    path = graph.save(tmp_path / f"graph{suffix}")
    loaded = OpGraph.load(path)
    assert loaded == graph
    assert loaded.content_hash() == graph.content_hash()
    assert list(loaded.edges()) == list(graph.edges())
    # byte-stable: saving the loaded graph gives the same bytes
    again = loaded.save(tmp_path / f"again{suffix}")
    assert again.read_bytes() == path.read_bytes()


def test_saved_capture_writes_graph_and_onnx(capture_example, tmp_path: Path) -> None:
    import onnx

    result = capture_example("mlp")
    written = result.save(tmp_path / "out")
    assert set(written) == {"graph", "onnx"}
    graph = OpGraph.load(written["graph"])
    assert graph.onnx.file == "model.onnx"
    model = onnx.load(str(written["onnx"]))
    onnx.checker.check_model(model)
    # weightless: weights are graph inputs with shapes, not initializers
    assert not model.graph.initializer
    names = {i.name for i in model.graph.input}
    assert {"layers.0.weight", "head.bias", "x"} <= names


def test_hash_is_stable_across_captures() -> None:
    first = capture_graph(EXAMPLES / "transformer.py", 2, onnx=False).graph
    second = capture_graph(EXAMPLES / "transformer.py", 2, onnx=False).graph
    assert first.content_hash() == second.content_hash()
    assert first == second
    # The hash describes the model, not the batch it was captured at.
    other_batch = capture_graph(EXAMPLES / "transformer.py", 3, onnx=False).graph
    assert other_batch.content_hash() == first.content_hash()
    assert other_batch.inputs != first.inputs


def test_hash_changes_with_the_model(tmp_path: Path) -> None:
    src = (EXAMPLES / "mlp.py").read_text()
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(src)
    b.write_text(src.replace("HIDDEN = 256", "HIDDEN = 128"))
    ga = capture_graph(a, 2, onnx=False).graph
    gb = capture_graph(b, 2, onnx=False).graph
    assert ga.content_hash() != gb.content_hash()
    # but not with where the file lives or what it is called (same model, same hash)
    c = tmp_path / "sub" / "renamed.py"
    c.parent.mkdir()
    c.write_text(src)
    assert capture_graph(c, 2, onnx=False).graph.content_hash() == ga.content_hash()


def test_tampered_file_is_rejected(capture_example, tmp_path: Path) -> None:
    path = capture_example("mlp").graph.save(tmp_path / "g.json")
    data = json.loads(path.read_text())
    data["nodes"][0]["flops"] += 1
    path.write_text(json.dumps(data))
    with pytest.raises(GraphFileError, match="does not match its recorded graph_hash"):
        OpGraph.load(path)


@pytest.mark.parametrize("content, fragment", [
    (b"{not json", "cannot read OpGraph file"),
    (b"[1, 2]", "is not an OpGraph file"),
    (b'{"format_version": 99}', "unsupported OpGraph format_version"),
    (b'{"format_version": 1, "nodes": []}', "malformed OpGraph file"),
    (gzip.compress(b"{", mtime=0)[:10], "cannot read OpGraph file"),
])
def test_bad_files_are_user_errors(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "g.json"
    path.write_bytes(content)
    with pytest.raises(GraphFileError, match=fragment):
        OpGraph.load(path)
    with pytest.raises(GraphFileError, match="not found"):
        OpGraph.load(tmp_path / "missing.json")
