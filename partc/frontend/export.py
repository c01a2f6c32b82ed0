"""Capture: a model file's nn.Module -> torch.export ExportedProgram at a batch size.

The model is captured in training mode (dropout and batch-norm statistics updates are part of what
gets partitioned). A model whose parameters or buffers are on the meta device is captured on the
meta device, never materialised: export only needs shapes, so a 1.3B-parameter GPT-2 captures in a
few hundred MB.

The program is exported twice, at the batch size B and at 2B. The second capture is only read for
shapes and FLOPs: comparing them tells exactly which tensor dimension is the batch and how each
node's FLOPs grow with it, so later passes can price any micro-batch size (see partc.graph.opgraph).
"""
from __future__ import annotations

import contextlib
import io
import logging
import re
import sysconfig
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from partc.errors import CaptureError, summarize_exception
from partc.frontend.attention_masks import simplify_attention_masks
from partc.frontend.model_file import (
    Inputs,
    ModelFile,
    input_leaves,
    inputs_to_meta,
    is_on_meta,
)
from partc.progress import Progress


@dataclass
class Capture:
    """The exported program of a model at one batch size, plus what the program does not say."""

    model_file: ModelFile
    model: torch.nn.Module
    batch_size: int
    on_meta: bool
    inputs: Inputs
    exported: ExportedProgram
    scaled: ExportedProgram | None  # the same model at `scaled_batch_size`, for batch dims/FLOPs
    scaled_batch_size: int
    tied: dict[str, tuple[str, ...]]  # every FQN of a tied tensor -> all FQNs of that tensor
    trainable: dict[str, bool]  # parameter FQN -> requires_grad


def tied_groups(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Names that refer to one tensor (tied weights), from the module tree itself."""
    by_id: dict[int, list[str]] = {}
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        by_id.setdefault(id(tensor), []).append(name)
    groups: dict[str, tuple[str, ...]] = {}
    for names in by_id.values():
        if len(names) > 1:
            for name in names:
                groups[name] = tuple(names)
    return groups


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence export/ONNX chatter (progress prints, graph dumps logged on failure, torchvision and
    deprecation notices) that would bury partc's own one-line output; real errors still raise."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        logging.disable(previous)


_EXPORT_HINTS: tuple[tuple[str, str], ...] = (
    ("Cache", "the model returns a KV cache (e.g. HF DynamicCache): build it with use_cache=False"),
    ("data-dependent", "forward() branches on tensor values, which torch.export cannot capture: "
                       "use tensor ops or torch.cond instead of Python if/loops on tensor data"),
    ("DataDependent", "forward() branches on tensor values, which torch.export cannot capture: "
                      "use tensor ops or torch.cond instead of Python if/loops on tensor data"),
    ("not a known type", "forward() returns or takes a custom type: use tensors, or tuples, lists, "
                         "dicts or dataclasses of tensors (or register the type with "
                         "torch.utils._pytree)"),
    ("same device", "the model mixes devices; build it on one device (or entirely on meta)"),
)


def export_program(model: torch.nn.Module, inputs: Inputs, where: str) -> ExportedProgram:
    """torch.export.export with user-facing errors: one line naming the cause, with a hint."""
    args, kwargs = inputs
    try:
        with quiet_torch():
            exported = torch.export.export(model, args, kwargs)
    except Exception as exc:
        reason = summarize_exception(exc)
        full = f"{exc} {exc.__cause__ or ''}"
        hint = next((h for key, h in _EXPORT_HINTS if key in full),
                    "make forward() capturable by torch.export "
                    "(https://pytorch.org/docs/stable/export.html); pass --debug for the traceback")
        # the model's own line that raised (a branch on a tensor's value: HF wav2vec2's
        # LayerDrop `if not skip_the_layer`), which torch's message never names
        source = _raising_model_line(exc)
        raise CaptureError(f"torch.export failed on {where}"
                           + (f" at {source}" if source else "") + f": {reason}",
                           hint=hint) from exc
    refuse_data_dependent_shapes(exported, where)
    # constant attention masks that mask nothing or only the future: none, or is_causal, as the
    # model runs eagerly (flash kernels; partc.frontend.attention_masks)
    return simplify_attention_masks(exported)


def refuse_data_dependent_shapes(exported: ExportedProgram, where: str) -> None:
    """CaptureError naming the first operator whose output size depends on tensor values
    (boolean-mask indexing, nonzero, unique: torch.export represents the size by an unbacked
    symbol) and the model's source line that calls it. partc prices, cuts and traces fixed shapes:
    such a size has no value to plan for."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        values = pytree.tree_leaves(node.meta.get("val"))
        # tensors only: a scalar read with .item() is unbacked too, but no shape depends on it
        if not any(isinstance(v, torch.Tensor) and free_unbacked_symbols(v.shape)
                   for v in values):
            continue
        source = _user_line(str(node.meta.get("stack_trace") or ""))
        raise CaptureError(
            f"{where}: operator {node.target} ({node.name}) gives a data-dependent shape"
            + (f" at {source}" if source else "") + ": its size depends on tensor values, and "
            "partc plans fixed shapes",
            hint="keep shapes fixed: mask by multiplying or torch.where instead of boolean "
                 "indexing, nonzero or unique (pad to a maximum size where a variable count is "
                 "needed)")


# frames in torch and partc are the capture's machinery, in the standard library the with-blocks
# and wrappers around it; installed libraries (transformers) hold models' code, also where
# site-packages sits inside the standard library's folder (a pyenv or system Python)
_MACHINERY = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parent.parent)
_LIBRARIES = tuple({Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")})
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def _is_model_code(filename: str) -> bool:
    path = Path(filename)
    if not path.is_absolute():  # <string>, <frozen ...>
        return False
    path = path.resolve()
    if any(path.is_relative_to(d) for d in _MACHINERY):
        return False
    return any(path.is_relative_to(d) for d in _LIBRARIES) or not path.is_relative_to(_STDLIB)


def refuse_values_drawn_at_capture(model: torch.nn.Module, inputs: Inputs,
                                   exported: ExportedProgram, scaled: ExportedProgram,
                                   where: str) -> None:
    """CaptureError for a value that forward() makes from data outside torch (numpy or Python
    randomness, a counter, the clock) and that changes from one capture to the next. Export
    records such a tensor as a constant, and such a number (`x * random.random()`, a slice at
    `random.randint(...)`) as a literal argument of an operator: the plan would hold the one
    draw made while capturing for every step of training (HF wav2vec2's SpecAugment masks,
    drawn with numpy).

    A constant that differs between the captures at B and 2B may only follow the batch size
    (`torch.tensor(x.shape[0])`), and so may a literal (a view's sizes, `1 / x.shape[0]`; one
    that changes by exactly 2x is taken to), so those are checked against a second capture at
    B, made only when there are any: a value that differs between two captures at one size was
    drawn. Meta constants have no values to compare; a draw that repeats (two captures drawing
    the same value) is not seen; a program whose operators differ between captures (a branch
    on a draw, or a cache the first call fills) is not compared literal by literal."""
    first = _constant_tensors(exported)
    second = _constant_tensors(scaled)
    suspects = [name for name, (a, _) in sorted(first.items())
                if not a.is_meta and not _same(a, second.get(name, (None, None))[0])]
    first_literals = _literals(exported)
    suspect_literals = _literal_changes(first_literals, _literals(scaled), _follows_the_batch)
    if not suspects and not suspect_literals:
        return
    again_program = export_program(model, inputs, where)  # as `exported` was made
    again = _constant_tensors(again_program)
    hint = ("make it with torch operators (torch.rand, torch.bernoulli, torch.randperm: "
            "captured as operators and drawn again every step), or turn it off (HF audio "
            "models' SpecAugment: mask_time_prob=0.0 and mask_feature_prob=0.0)")
    for name in suspects:
        a, node = first[name]
        if _same(a, again.get(name, (None, None))[0]):
            continue
        used = next((_user_line(str(u.meta.get("stack_trace") or "")) for u in node.users), "")
        raise CaptureError(
            f"{where}: forward() makes the tensor {name} ({dtype_name(a.dtype)}"
            f"{list(a.shape)}) from data outside torch"
            + (f", used at {used}" if used else "")
            + ", and two captures drew different values: the plan would hold one draw for every "
            "step", hint=hint)
    again_literals = _literals(again_program)
    drawn = _literal_changes(first_literals, again_literals, _equal_numbers)
    for index, position in sorted(suspect_literals & drawn):
        node, values = first_literals[index]
        value, again_value = values[position], again_literals[index][1][position]
        used = _user_line(str(node.meta.get("stack_trace") or ""))
        raise CaptureError(
            f"{where}: forward() passes {_operator_name(node)} the number {value!r} made from "
            f"data outside torch" + (f" at {used}" if used else "")
            + f", and two captures drew different values ({value!r}, {again_value!r}): the plan "
            "would hold one draw for every step", hint=hint)


_Number = int | float


def _literals(exported: ExportedProgram) -> list[tuple[torch.fx.Node, list[_Number]]]:
    """Every operator call of the program with the numbers among its arguments, in order
    (inside lists, tuples and keyword arguments too; bools, dtypes and nodes left out)."""
    out: list[tuple[torch.fx.Node, list[_Number]]] = []
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        values: list[_Number] = []
        _numbers(node.args, values)
        for key in sorted(node.kwargs):
            _numbers(node.kwargs[key], values)
        out.append((node, values))
    return out


def _numbers(arg: object, into: list[_Number]) -> None:
    if isinstance(arg, bool):
        return
    if isinstance(arg, (int, float)):
        into.append(arg)
    elif isinstance(arg, (list, tuple)):
        for item in arg:
            _numbers(item, into)


def _literal_changes(a: list[tuple[torch.fx.Node, list[_Number]]],
                     b: list[tuple[torch.fx.Node, list[_Number]]],
                     same: Callable[[_Number, _Number], bool]) -> set[tuple[int, int]]:
    """(operator index, number index) of the numbers two programs of the same operators pass
    differently by `same`; none where the operators or their numbers' counts differ."""
    if len(a) != len(b) or any(na.target != nb.target or len(va) != len(vb)
                               for (na, va), (nb, vb) in zip(a, b, strict=True)):
        return set()
    return {(i, j) for i, ((_, va), (_, vb)) in enumerate(zip(a, b, strict=True))
            for j, (x, y) in enumerate(zip(va, vb, strict=True)) if not same(x, y)}


def _equal_numbers(a: _Number, b: _Number) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _follows_the_batch(a: _Number, b: _Number) -> bool:
    """Whether a number at B and at 2B may be one computed from the batch size: equal, or
    twice or half the other (sizes, counts, their reciprocals)."""
    return _equal_numbers(a, b) or b == 2 * a or a == 2 * b


def _operator_name(node: torch.fx.Node) -> str:
    """'aten.mul.Tensor' for the node of torch.ops.aten.mul.Tensor."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return str(getattr(target, "__name__", target))


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Equal dtype, shape and values (NaNs where each other's are)."""
    if b is None or b.is_meta or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
        a, b, rtol=0.0, atol=0.0, equal_nan=True))


def _constant_tensors(exported: ExportedProgram) -> dict[str, tuple[torch.Tensor, torch.fx.Node]]:
    """Lifted tensor constants (not parameters or buffers) -> (value, placeholder node)."""
    from torch.export.graph_signature import InputKind

    nodes = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    found: dict[str, tuple[torch.Tensor, torch.fx.Node]] = {}
    for spec in exported.graph_signature.input_specs:
        if spec.kind != InputKind.CONSTANT_TENSOR or spec.target is None:
            continue
        value = exported.constants.get(spec.target)
        node = nodes.get(getattr(spec.arg, "name", ""))
        if isinstance(value, torch.Tensor) and node is not None:
            found[spec.target] = (value, node)
    return found


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the dtype as plans, OpGraphs and messages write it."""
    return str(dtype).removeprefix("torch.")


def _raising_model_line(exc: BaseException) -> str:
    """'file.py:14 (`if x.sum() > 0:`)': the innermost frame outside torch, partc and the
    standard library in the traceback of `exc` or its causes (the model's code, or a library
    it calls), '' if none."""
    chain: list[BaseException] = []
    inner: BaseException | None = exc
    while inner is not None and all(inner is not e for e in chain):
        chain.append(inner)
        inner = inner.__cause__
    for raised in reversed(chain):  # the innermost cause's traceback reaches deepest
        for frame in reversed(traceback.extract_tb(raised.__traceback__)):
            if not _is_model_code(frame.filename):
                continue
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            code = (frame.line or "").strip()
            return f"{where} (`{code}`)" if code else where
    return ""


def _user_line(stack_trace: str) -> str:
    """'file.py:14 (`h = h[h.sum(-1) > 0]`)' for the innermost frame of an FX stack trace that
    is the model's code (not torch's `F.embedding` inside nn.Embedding), else the innermost."""
    lines = stack_trace.strip().splitlines()
    frames: list[str] = []
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(r'\s*File "([^"]+)", line (\d+)', lines[i])
        if found:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f"{Path(found.group(1)).name}:{found.group(2)}"
            shown = f"{where} (`{code}`)" if code else where
            if _is_model_code(found.group(1)):
                return shown
            frames.append(shown)
    return frames[0] if frames else ""


def refuse_sparse_gradients(exported: ExportedProgram, trainable: dict[str, bool],
                            where: str) -> None:
    """CaptureError for a trainable parameter that an operator would give a sparse gradient
    (`nn.Embedding(..., sparse=True)`, `nn.EmbeddingBag(..., sparse=True)`: any operator with a
    `sparse` flag set). partc trains dense gradients: its optimizers (Adam and AdamW refuse
    sparse ones), the data-parallel gradient sync and ZeRO sharding all read a gradient's
    storage, which a sparse tensor has none of (the launch failed on its first backward)."""
    parameters = exported.graph_signature.inputs_to_parameters
    for node in exported.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.name != "sparse":
                continue
            value = node.args[i] if i < len(node.args) else \
                node.kwargs.get("sparse", argument.default_value)
            weight = node.args[0] if node.args else None
            name = parameters.get(getattr(weight, "name", ""))
            if value is True and name is not None and trainable.get(name, True):
                source = _user_line(node.meta.get("stack_trace") or "")
                raise CaptureError(
                    f"{where}: parameter {name} would get a sparse gradient "
                    f"({_operator_name(node)} with sparse=True"
                    + (f" at {source}" if source else "") + "): partc trains dense gradients "
                    "(its optimizers, data-parallel sync and ZeRO sharding need them)",
                    hint="build the embedding with sparse=False (the same gradient values, "
                         "stored dense), or freeze that parameter")


def _input_tensors(inputs: Inputs) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in input_leaves(inputs) if isinstance(t, torch.Tensor)]


def refuse_inputs_without_a_batch(inputs: Inputs, scaled_inputs: Inputs, batch: int,
                                  scaled_batch: int, file_name: str) -> None:
    """CaptureError when example_inputs returns the same tensor shapes at two batch sizes: it
    ignores its batch_size, and a plan for batch B would be compiled, priced and split into
    micro-batches on inputs of some other size, with no dimension to split them along."""
    before, after = _input_tensors(inputs), _input_tensors(scaled_inputs)
    if not before or [n for n, _ in before] != [n for n, _ in after]:
        return  # no tensors, or a different structure: export and the batch-dim search judge
    if any(a.shape != b.shape for (_, a), (_, b) in zip(before, after, strict=True)):
        return
    shown = ", ".join(f"{n} {list(t.shape)}" for n, t in before[:3])
    raise CaptureError(
        f"example_inputs({batch}) and example_inputs({scaled_batch}) in {file_name} return "
        f"tensors of the same shapes ({shown}{', ...' if len(before) > 3 else ''}): it ignores "
        "its batch_size, and partc splits a batch into micro-batches along the dimension that "
        "grows with it",
        hint="make example_inputs(batch_size) build batch_size samples (docs/model-files.md)")


def output_paths(exported: ExportedProgram) -> list[str]:
    """Where each flat output sits in the model's output structure, as pytree key strings:
    "['logits']" for dicts and HF ModelOutputs, '[0]' for tuples, '<output>' for a lone tensor."""
    out_spec = exported.call_spec.out_spec
    if out_spec is None:
        return [f"[{i}]" for i in range(len(exported.graph_signature.user_outputs))]
    placeholder = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
    leaves, _ = pytree.tree_flatten_with_path(placeholder)
    return [pytree.keystr(path) or "<output>" for path, _ in leaves]


def _check_outputs(exported: ExportedProgram, where: str) -> None:
    from torch.export.graph_signature import OutputKind, TensorArgument

    paths = output_paths(exported)
    user = [s for s in exported.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    if not user:
        raise CaptureError(f"{where} returns no tensors",
                           hint="forward() must return the tensors the loss is computed from")
    for path, spec in zip(paths, user, strict=True):
        if not isinstance(spec.arg, TensorArgument):
            value = getattr(spec.arg, "value", spec.arg)
            raise CaptureError(
                f"{where} returns a non-tensor output at {path}: {type(value).__name__} {value!r}",
                hint="return only tensors (tuples/dicts/dataclasses of tensors); drop other values")


def capture(model_file: ModelFile, batch_size: int, progress: Progress | None = None) -> Capture:
    """Build the model file's model and export it at `batch_size` (and at 2x for batch scaling)."""
    progress = progress or Progress()
    if batch_size < 1:
        raise CaptureError(f"batch size must be >= 1, got {batch_size}",
                           hint="pass --batch-size 1 or more")
    with progress.step(f"building the model from {model_file.path}"):
        model = model_file.build()
        on_meta = is_on_meta(model)
        if on_meta:
            # A partly-meta model cannot run; moving it whole to meta costs nothing and keeps
            # the shapes, which is all that capture needs.
            model = model.to("meta")
        model.train()
        inputs = model_file.inputs(batch_size)
        if on_meta:
            inputs = inputs_to_meta(inputs)
        tied = tied_groups(model)
        trainable = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    where = f"{model_file.name} (batch size {batch_size})"
    with progress.step(f"capturing with torch.export at batch size {batch_size}"):
        exported = export_program(model, inputs, where)
        _check_outputs(exported, where)
        refuse_sparse_gradients(exported, trainable, where)
    scaled_batch = 2 * batch_size
    scaled: ExportedProgram | None = None
    with progress.step(f"capturing at batch size {scaled_batch} to find batch dimensions"):
        scaled_inputs = model_file.inputs(scaled_batch)
        if on_meta:
            scaled_inputs = inputs_to_meta(scaled_inputs)
        refuse_inputs_without_a_batch(inputs, scaled_inputs, batch_size, scaled_batch,
                                      model_file.path.name)
        try:
            scaled = export_program(model, scaled_inputs,
                                    f"{model_file.name} (batch size {scaled_batch})")
        except CaptureError as exc:
            # Not fatal: batch dims then fall back to a shape heuristic (noted in the OpGraph).
            progress.warn(f"second capture failed, batch dimensions are guessed: {exc.message}")
    if scaled is not None:
        refuse_values_drawn_at_capture(model, inputs, exported, scaled, where)
    return Capture(model_file=model_file, model=model, batch_size=batch_size, on_meta=on_meta,
                   inputs=inputs, exported=exported, scaled=scaled, scaled_batch_size=scaled_batch,
                   tied=tied, trainable=trainable)
