"""The model-file contract: loading, input forms, defaults for loss and data."""
from __future__ import annotations

import pytest
import torch
from conftest import EXAMPLES, TEST_MODELS

from partc.errors import ModelFileError
from partc.frontend.model_file import default_loss_fn, load_model_file, normalize_inputs


def test_input_forms_normalise_to_args_kwargs() -> None:
    t = torch.zeros(2, 3)
    assert normalize_inputs(t) == ((t,), {})
    assert normalize_inputs((t, t)) == ((t, t), {})
    assert normalize_inputs([t]) == ((t,), {})
    assert normalize_inputs({"x": t}) == ((), {"x": t})
    args, kwargs = normalize_inputs(((t,), {"mask": t}))
    assert args == (t,) and kwargs == {"mask": t}


@pytest.mark.parametrize("raw", [42, "x", None, {1: torch.zeros(1)}])
def test_bad_input_forms_are_user_errors(raw: object) -> None:
    with pytest.raises(ModelFileError):
        normalize_inputs(raw)


@pytest.mark.parametrize("name, fragment", [
    ("does_not_exist.py", "model file not found"),
    ("no_build.py", "does not define build_model()"),
    ("raises_on_import.py", "RuntimeError: cannot reach the dataset server"),
    ("syntax_error.py", "syntax error at line 1"),
])
def test_load_errors_name_the_cause(name: str, fragment: str) -> None:
    with pytest.raises(ModelFileError) as info:
        load_model_file(TEST_MODELS / name)
    assert fragment in info.value.message
    assert info.value.hint


def test_directory_is_not_a_model_file() -> None:
    with pytest.raises(ModelFileError, match="is a directory"):
        load_model_file(TEST_MODELS)


def test_build_must_return_a_module() -> None:
    mf = load_model_file(TEST_MODELS / "not_a_module.py")
    with pytest.raises(ModelFileError, match="not a torch.nn.Module"):
        mf.build()


def test_example_inputs_must_have_an_accepted_form() -> None:
    mf = load_model_file(TEST_MODELS / "bad_inputs.py")
    with pytest.raises(ModelFileError, match="returned int"):
        mf.inputs(2)


def test_optional_functions_are_found_or_absent() -> None:
    mlp = load_model_file(EXAMPLES / "mlp.py")
    assert mlp.loss_fn is not None and mlp.batches is not None
    big = load_model_file(EXAMPLES / "gpt2_1p3b_meta.py")
    assert big.loss_fn is None and big.batches is None
    assert big.loss() is default_loss_fn


def test_loading_twice_gives_the_same_module_name() -> None:
    a = load_model_file(EXAMPLES / "mlp.py")
    b = load_model_file(EXAMPLES / "mlp.py")
    assert a.module_name == b.module_name == "partc_model_mlp"


def test_default_loss_classification_and_regression() -> None:
    logits = torch.randn(2, 5, 7)
    target = torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), target.reshape(-1))
    assert torch.allclose(default_loss_fn(logits, target), expected)
    # first tensor of a structured output
    assert torch.allclose(default_loss_fn({"logits": logits, "aux": torch.ones(1)}, target),
                          expected)
    out, tgt = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.allclose(default_loss_fn(out, tgt), torch.nn.functional.mse_loss(out, tgt))


def test_synthetic_batches_match_example_shapes_and_are_deterministic() -> None:
    mf = load_model_file(TEST_MODELS / "string_output.py")
    mf.batches = None  # use the synthetic data source
    mf.build_model = lambda: torch.nn.Linear(4, 6)
    # strict=False: the first three batches of an endless data source
    first = [b for _, b in zip(range(3), mf.data(5), strict=False)]
    again = [b for _, b in zip(range(3), mf.data(5), strict=False)]
    for ((args, kwargs), target), ((args2, _), target2) in zip(first, again, strict=True):
        assert args[0].shape == (5, 4) and not kwargs
        assert target.shape == (5,) and int(target.max()) < 6
        assert torch.equal(args[0], args2[0]) and torch.equal(target, target2)
    assert not torch.equal(first[0][0][0][0], first[1][0][0][0])  # fresh data every step


def test_synthetic_batches_for_a_meta_model_do_not_materialise(tmp_path) -> None:
    src = tmp_path / "meta_lm.py"
    src.write_text(
        "import torch, torch.nn as nn\n"
        "def build_model():\n"
        "    with torch.device('meta'):\n"
        "        return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))\n"
        "def example_inputs(batch_size):\n"
        "    return (torch.randint(0, 50, (batch_size, 6)), )\n")
    mf = load_model_file(src)
    (args, _), target = next(iter(mf.data(3)))
    assert args[0].shape == (3, 6) and not args[0].is_meta
    assert target.shape == (3, 6) and target.dtype == torch.int64 and int(target.max()) < 50


def test_default_loss_accepts_int32_targets() -> None:
    logits = torch.randn(4, 3)
    target = torch.tensor([0, 1, 2, 1], dtype=torch.int32)
    assert torch.allclose(default_loss_fn(logits, target),
                          torch.nn.functional.cross_entropy(logits, target.long()))


def test_model_file_batches_are_normalised() -> None:
    mf = load_model_file(EXAMPLES / "bert.py")
    (args, kwargs), (mlm, nsp) = next(iter(mf.data(3)))
    assert args == () and set(kwargs) == {"input_ids", "attention_mask", "token_type_ids"}
    assert mlm.shape == (3, 32) and nsp.shape == (3,)


def _loss_file(tmp_path, body: str):
    src = tmp_path / "own_loss_fn.py"
    src.write_text("import torch, torch.nn as nn\n"
                   "def build_model():\n    return nn.Linear(4, 3)\n"
                   "def example_inputs(batch_size):\n    return (torch.randn(batch_size, 4),)\n"
                   f"def loss_fn(output, target):\n{body}\n")
    return load_model_file(src).loss()


@pytest.mark.parametrize("body, fragment", [
    ("    return nn.functional.cross_entropy(output, target, reduction='none')",
     "returned a float32 tensor of shape [2], not one floating-point number"),
    ("    return nn.functional.cross_entropy(output, target).item()",
     "returned a float, not one floating-point number"),
    ("    return (output.argmax(-1) == target).sum()",
     "returned a int64 tensor of shape [], not one floating-point number"),
    ("    return nn.functional.cross_entropy(output, target[:, None])",
     "raised RuntimeError: "),
], ids=["vector", "python-float", "integer", "raises"])
def test_a_loss_fn_that_is_no_loss_is_named(tmp_path, body: str, fragment: str) -> None:
    """What loss_fn returns must be one floating number, what it raises is named as its own:
    on a pipeline's last stage torch's words alone ("grad can be implicitly created only for
    scalar outputs") never said which code was wrong."""
    loss = _loss_file(tmp_path, body)
    with pytest.raises(ModelFileError) as raised:
        loss(torch.randn(2, 3, requires_grad=True), torch.tensor([0, 2]))
    assert raised.value.message.startswith("loss_fn in ") and fragment in raised.value.message


def test_a_loss_fn_of_one_number_passes_and_out_of_memory_stays_itself(tmp_path) -> None:
    """A loss of shape [1] is one number (backward() starts from it); out of memory is the
    size's, not the code's, and reaches the size search unchanged."""
    loss = _loss_file(tmp_path, "    return nn.functional.cross_entropy(output, target)[None]")
    value = loss(torch.randn(2, 3, requires_grad=True), torch.tensor([0, 2]))
    value.backward()
    oom = _loss_file(tmp_path, "    raise torch.OutOfMemoryError('CUDA out of memory. Tried')")
    with pytest.raises(torch.OutOfMemoryError):
        oom(torch.randn(2, 3), torch.tensor([0, 2]))


def _with_batches(tmp_path, inputs: str, batch: str, target: str = "torch.zeros(b)"):
    src = tmp_path / "own_batches.py"
    src.write_text("import torch, torch.nn as nn\n"
                   "def build_model():\n    return nn.Linear(4, 3)\n"
                   f"def example_inputs(b):\n    return {inputs}\n"
                   f"def batches(b):\n    while True:\n        yield {batch}, {target}\n")
    return load_model_file(src)


EXAMPLE = "((torch.randn(b, 4),), {'mask': torch.ones(b, 4), 'scale': 2.0})"


@pytest.mark.parametrize("batch, fragment", [
    ("((torch.randn(b, 4),), {'mask': torch.ones(b, 4), 'scale': 3.0})",
     "kwargs['scale'] is 3.0, example_inputs gives 2.0"),
    ("((torch.randn(b, 4),), {'mask': torch.ones(b, 4), 'scale': 2.0, 'extra': 1})",
     "kwargs['extra'] not in example_inputs"),
    ("((torch.randn(b, 4),), {'scale': 2.0})", "no kwargs['mask']"),
    ("((torch.randn(b, 5),), {'mask': torch.ones(b, 4), 'scale': 2.0})",
     "args[0] is [2, 5] float32, example_inputs gives [2, 4] float32"),
    ("((torch.randn(b, 4).double(),), {'mask': torch.ones(b, 4), 'scale': 2.0})",
     "args[0] is [2, 4] float64, example_inputs gives [2, 4] float32"),
    ("((torch.randn(b, 4),), {'mask': None, 'scale': 2.0})",
     "kwargs['mask'] is None, example_inputs gives [2, 4] float32"),
], ids=["value", "extra", "missing", "shape", "dtype", "none-for-tensor"])
def test_batches_unlike_example_inputs_are_named(tmp_path, batch: str, fragment: str) -> None:
    """The plan is captured from example_inputs: data with other arguments, shapes, dtypes or
    non-tensor values (which export bakes in: a 3.0 would train with the 2.0) is refused where
    a batch is first drawn (compile, verify, launch) in one line."""
    mf = _with_batches(tmp_path, EXAMPLE, batch)
    with pytest.raises(ModelFileError) as raised:
        mf.first_batch(2)
    assert "yields inputs unlike example_inputs(2): " in raised.value.message
    assert fragment in raised.value.message


def test_batches_like_example_inputs_pass_in_any_keyword_order(tmp_path) -> None:
    mf = _with_batches(tmp_path, EXAMPLE,  # 2 for 2.0: the same number to the program
                       "((torch.zeros(b, 4),), {'scale': 2, 'mask': torch.zeros(b, 4)})")
    (args, kwargs), _ = mf.first_batch(3)
    assert args[0].shape == (3, 4) and set(kwargs) == {"mask", "scale"}


@pytest.mark.parametrize("target, ok", [
    ("torch.zeros(b - 1)", False),
    ("{'labels': torch.zeros(b + 1, 2), 'weight': torch.ones(3)}", False),
    ("{'labels': torch.zeros(b, 2), 'weight': torch.ones(3)}", True),
    ("torch.tensor(0.5)", True),  # no per-sample tensor: the model computes its own loss
    ("None", True),
], ids=["short", "dict-long", "dict-with-a-table", "scalar", "none"])
def test_a_target_without_the_batchs_samples_is_named(tmp_path, target: str, ok: bool) -> None:
    """verify said loss_fn's own error ("Expected input batch_size (4) to match target
    batch_size (3)"), compile said nothing, launch a message of its own: now one check, where a
    batch is first drawn and (launch) on every step."""
    mf = _with_batches(tmp_path, "(torch.randn(b, 4),)", "(torch.randn(b, 4),)", target)
    if ok:
        mf.first_batch(4)
        return
    with pytest.raises(ModelFileError, match=r"batches\(4\) in .* yields a target without 4 "
                                             r"samples: none of its tensors has 4 rows in dim 0"):
        mf.first_batch(4)


def test_batches_on_the_meta_device_are_refused(tmp_path) -> None:
    """Data built under a meta device context has no values: verify was an internal error
    ("Cannot copy out of meta tensor") and launch failed on its first copy."""
    mf = _with_batches(tmp_path, "(torch.randn(b, 4),)", "(torch.randn(b, 4, device='meta'),)")
    with pytest.raises(ModelFileError, match=r"batches\(2\) in .* yielded tensors on the meta "
                                             r"device at item 0"):
        mf.first_batch(2)
