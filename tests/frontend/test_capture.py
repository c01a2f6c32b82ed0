"""Capture edge cases: meta-device models, export failures, ONNX failure fallback."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import TEST_MODELS

from partc.errors import CaptureError
from partc.frontend.capture import capture_graph
from partc.frontend.export import capture
from partc.frontend.model_file import load_model_file


def test_partly_meta_model_is_captured_on_meta_without_materialising() -> None:
    result = capture_graph(TEST_MODELS / "partly_meta.py", 2)
    assert result.capture.on_meta and result.graph.on_meta
    assert all(p.is_meta for p in result.capture.model.parameters())
    big = result.graph.node("linear_1")
    assert big.outputs[0].shape == (2, 4096) and big.flops == 2 * 2 * 8 * 4096
    assert result.graph.onnx.status == "ok"


def test_onnx_failure_is_a_warning_and_the_graph_still_builds() -> None:
    result = capture_graph(TEST_MODELS / "qr_layer.py", 2)
    graph = result.graph
    assert graph.onnx.status == "failed"
    assert graph.onnx.error and "\x1b[" not in graph.onnx.error
    assert result.onnx is not None and result.onnx.model is None
    kinds = [n.kind for n in graph.nodes]
    assert "linalg_qr" in kinds and kinds.count("linear") == 2
    assert graph.node("linear").flops == 2 * 2 * 16 * 16
    assert all(not n.onnx_nodes for n in graph.nodes)


@pytest.mark.parametrize("model, fragment, hint", [
    ("gpt2_with_cache.py", "DynamicCache", "use_cache=False"),
    ("data_dependent.py", "torch.export failed", "branches on tensor values"),
    ("int_output.py", "non-tensor output at [1]: int 3", "return only tensors"),
    ("string_output.py", "non-tensor output at [1]: str 'done'", "return only tensors"),
])
def test_export_failures_are_one_line_user_errors(model: str, fragment: str, hint: str) -> None:
    mf = load_model_file(TEST_MODELS / model)
    with pytest.raises(CaptureError) as info:
        capture(mf, 2)
    assert fragment in info.value.message
    assert hint in info.value.hint
    assert "\n" not in info.value.one_line()


def test_batch_size_must_be_positive() -> None:
    mf = load_model_file(TEST_MODELS / "int_output.py")
    with pytest.raises(CaptureError, match="batch size must be >= 1"):
        capture(mf, 0)


def test_mixture_of_experts_matmuls_count_their_flops() -> None:
    """HF Mixtral's experts: every token's top-k experts each run the gate/up (H -> 2 I) and down
    (I -> H) projections, through transformers' grouped-matmul operator; counted from its shapes
    as the analytic model's matmuls, not as 0-FLOP elementwise work."""
    from partc.cost.op_classes import op_class

    spec = importlib.util.spec_from_file_location("tiny_mixtral", TEST_MODELS / "tiny_mixtral.py")
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    batch = 2
    graph = capture_graph(TEST_MODELS / "tiny_mixtral.py", batch).graph
    experts = [n for n in graph.nodes if n.kind == "grouped_mm_fallback"]
    assert len(experts) == 2 * m.LAYERS
    routed = batch * m.SEQ * m.TOP_K
    per_layer = 2 * routed * m.HIDDEN * 2 * m.INTERMEDIATE + 2 * routed * m.INTERMEDIATE * m.HIDDEN
    assert sum(n.flops for n in experts) == m.LAYERS * per_layer
    assert all(op_class(n.kind) == "matmul" for n in experts)
    assert not any("FLOPs unknown" in note for note in graph.notes)


def test_custom_operators_without_a_flop_formula_are_noted() -> None:
    graph = capture_graph(TEST_MODELS / "custom_op.py", 2).graph
    assert [n.flops for n in graph.nodes if n.kind == "scaled_tanh"] == [0, 0]
    assert any(note.startswith("FLOPs unknown for 2 call(s) of operators from outside torch "
                               "(partc_test::scaled_tanh)") for note in graph.notes), graph.notes


def test_the_raising_line_is_the_models_own_not_torchs_or_the_standard_librarys() -> None:
    # an export error names the innermost frame of model code: the model file's, or an
    # installed library's (transformers' modeling files), never torch's, partc's or a with-block's
    import contextlib

    import transformers

    from partc.frontend.export import _is_model_code

    assert _is_model_code(transformers.__file__)
    assert _is_model_code(str(TEST_MODELS / "data_dependent.py"))
    assert not _is_model_code(torch.nn.modules.module.__file__)
    assert not _is_model_code(contextlib.__file__)
    assert not _is_model_code("<string>")


def test_constants_that_follow_the_batch_size_are_no_draw() -> None:
    # its constants differ between the captures at B and 2B (1/B per sample, B itself), and a
    # third capture at B finds them as they were: it captures
    from partc.frontend.export import (
        _constant_tensors,
        _follows_the_batch,
        _literal_changes,
        _literals,
    )

    result = capture(load_model_file(TEST_MODELS / "batch_sized_constant.py"), 2)
    assert result.scaled is not None
    first, second = _constant_tensors(result.exported), _constant_tensors(result.scaled)
    assert sorted(first) == sorted(second) and len(first) == 2
    assert all(not torch.equal(first[n][0], second[n][0]) for n in first if
               first[n][0].shape == second[n][0].shape)
    # and a literal that changed between them by other than 2x, (n - 1) / n
    assert _literal_changes(_literals(result.exported), _literals(result.scaled),
                            _follows_the_batch)


@pytest.mark.parametrize("model, fragment", [
    ("python_random_scale.py", "forward() passes aten.mul.Tensor the number "),
    ("python_random_roll.py", "forward() passes aten.roll.default the number "),
])
def test_numbers_drawn_in_python_are_refused(model: str, fragment: str) -> None:
    """A Python draw in forward() is a literal of the captured program: refused in one line
    that names the model's line, not trained on as one draw for every step."""
    with pytest.raises(CaptureError) as refused:
        capture(load_model_file(TEST_MODELS / model), 2)
    message = str(refused.value)
    assert fragment in message and "two captures drew different values" in message
    assert f"at {model}:" in message and "random." in message


def test_a_frozen_sparse_embedding_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse gradient is refused (tests/test_bad_inputs.py); a frozen sparse embedding gets
    no gradient, so it is an ordinary lookup."""
    monkeypatch.setenv("PARTC_TEST_FROZEN_EMBEDDING", "1")
    result = capture(load_model_file(TEST_MODELS / "sparse_embedding.py"), 2)
    assert result.trainable == {"embed.weight": False, "head.weight": True, "head.bias": True}
    monkeypatch.setenv("PARTC_TEST_FROZEN_EMBEDDING", "0")
    with pytest.raises(CaptureError, match="embed.weight would get a sparse gradient"):
        capture(load_model_file(TEST_MODELS / "sparse_embedding.py"), 2)


def test_inputs_that_follow_the_batch_anywhere_are_not_refused(tmp_path) -> None:
    """The batch may sit in any dimension of any input, and other inputs may be fixed: only
    inputs that all keep their shapes from B to 2B are refused."""
    src = tmp_path / "batch_second.py"
    src.write_text("import torch, torch.nn as nn\n"
                   "class M(nn.Module):\n"
                   "    def __init__(self):\n        super().__init__()\n"
                   "        self.fc = nn.Linear(4, 4)\n"
                   "    def forward(self, x, table):\n"
                   "        return self.fc(x.transpose(0, 1)) + table.sum()\n"
                   "def build_model():\n    return M()\n"
                   "def example_inputs(batch_size):\n"
                   "    return ((torch.randn(7, batch_size, 4),), {'table': torch.ones(3)})\n")
    result = capture(load_model_file(src), 2)
    assert result.scaled is not None
