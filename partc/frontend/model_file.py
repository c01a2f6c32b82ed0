"""Loading a user's model file and checking it against the contract in docs/model-files.md.

A model file is a plain Python file that defines

    build_model() -> torch.nn.Module                      (required)
    example_inputs(batch_size: int) -> inputs             (required)
    loss_fn(output, target) -> Tensor                      (optional)
    batches(batch_size: int) -> iterable of (inputs, target)  (optional)

where `inputs` is a tuple of positional arguments, a dict of keyword arguments, a `(tuple, dict)`
pair, or a single tensor (shorthand for a 1-tuple).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.util
import io
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, TextIO

import torch
import torch.utils._pytree as pytree

from partc.errors import ModelFileError, PartcError, summarize_exception
from partc.frontend.model_source import read_model_source, syntax_error

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

_CONTRACT_HINT = ("a model file defines build_model() -> nn.Module and example_inputs(batch_size); "
                  "see docs/model-files.md")


@dataclass
class ModelFile:
    """A loaded model file: its path, the imported module, and the contract functions."""

    path: Path
    sha256: str  # of the bytes imported
    module: ModuleType
    module_name: str
    build_model: Callable[[], torch.nn.Module]
    example_inputs: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    batches: Callable[[int], Iterable[Any]] | None

    @property
    def name(self) -> str:
        return self.path.stem

    def display_class(self, qualified: str) -> str:
        """A class's qualified name with partc's import name of the file shown as the file's stem
        ('partc_model_mlp.MLP' -> 'mlp.MLP'); other classes unchanged."""
        prefix = self.module_name + "."
        if qualified.startswith(prefix):
            return self.name + "." + qualified[len(prefix):]
        return qualified

    def build(self) -> torch.nn.Module:
        """Call build_model() and check it returned an nn.Module."""
        with model_code(f"build_model() in {self.path}",
                        hint="run the model file's build_model() in Python to see the full "
                             "traceback, or pass --debug"):
            model = self.build_model()
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"build_model() in {self.path} returned {type(model).__name__}, "
                "not a torch.nn.Module",
                hint=_CONTRACT_HINT)
        return model

    def inputs(self, batch_size: int) -> Inputs:
        """Call example_inputs(batch_size) and normalise the result to (args, kwargs)."""
        with model_code(f"example_inputs({batch_size}) in {self.path}"):
            raw = self.example_inputs(batch_size)
        return normalize_inputs(raw, where=f"example_inputs({batch_size}) in {self.path}")

    def loss(self) -> Callable[[Any, Any], torch.Tensor]:
        """The model file's loss_fn, or `default_loss_fn` when it defines none. What it raises
        (out of memory aside: the size's, not the code's) and a result that is not one floating
        number (`reduction="none"`) become a ModelFileError naming loss_fn: raised on a
        pipeline's last stage, torch's own words ("grad can be implicitly created only for
        scalar outputs") never said which code was wrong."""
        fn = self.loss_fn
        if fn is None:
            return default_loss_fn
        where = f"loss_fn in {self.path}"

        def loss(output: Any, target: Any) -> torch.Tensor:
            with model_code(where, prints=False, passes=is_out_of_memory,
                            hint="call loss_fn on the model's output and a batch's target in "
                                 "Python to see the traceback"):
                value = fn(output, target)
            return _one_number(value, where)
        return loss

    def data(self, batch_size: int,
             output_shape: tuple[int, ...] | None = None) -> Iterator[tuple[Inputs, Any]]:
        """(inputs, target) pairs from the model file's batches(), normalised; or, when it defines
        none, synthetic batches (see `synthetic_batches`; `output_shape` is the first output's
        shape at `batch_size` when the caller knows it, e.g. from a plan)."""
        if self.batches is None:
            yield from synthetic_batches(self, batch_size, output_shape=output_shape)
            return
        with model_code(f"batches({batch_size}) in {self.path}", exceptions=False):
            items = iter(self.batches(batch_size))
        for i in itertools.count():
            with model_code(f"batches({batch_size}) in {self.path}", exceptions=False):
                item = next(items, _END)
            if item is _END:
                return
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ModelFileError(
                    f"batches({batch_size}) in {self.path} yielded {type(item).__name__} "
                    f"at item {i}, expected an (inputs, target) pair", hint=_CONTRACT_HINT)
            inputs, target = item
            normalized = normalize_inputs(inputs, where=f"batches({batch_size}) item {i}")
            if any(isinstance(t, torch.Tensor) and t.is_meta
                   for t in pytree.tree_leaves((normalized, target))):
                raise ModelFileError(
                    f"batches({batch_size}) in {self.path} yielded tensors on the meta device "
                    f"at item {i}: they hold no data to train on",
                    hint="build the batches' tensors on cpu (only the model may be on meta)")
            yield normalized, target

    def first_batch(self, batch_size: int,
                    output_shape: tuple[int, ...] | None = None) -> tuple[Inputs, Any]:
        """The first (inputs, target) pair of `data`; what the model file's code raises on the
        way, or a batches() that yields nothing, is a ModelFileError (one line)."""
        where = (f"batches({batch_size}) in {self.path}" if self.batches is not None
                 else f"example_inputs({batch_size}) in {self.path}")
        with model_code(where):
            item = next(iter(self.data(batch_size, output_shape=output_shape)), None)
        if item is None:
            raise ModelFileError(f"{where} yielded nothing",
                                 hint="make batches() yield at least one (inputs, target) pair")
        if self.batches is not None:
            self.check_like_examples(item[0], batch_size)
            self.check_target(item[1], batch_size)
        return item

    def check_target(self, target: Any, batch_size: int) -> None:
        """ModelFileError unless the target of a batch drawn from batches(batch_size) holds
        batch_size samples: some tensor of it has batch_size rows in dim 0 (that is how
        micro-batches and replicas split it). A target with no such tensor at all (None,
        scalars: the model computes its own loss from labels among its inputs) is fine."""
        leaves = [t for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor) and t.dim()]
        if leaves and not any(t.shape[0] == batch_size for t in leaves):
            shapes = ", ".join(str(list(t.shape)) for t in leaves[:3])
            raise ModelFileError(
                f"batches({batch_size}) in {self.path} yields a target without {batch_size} "
                f"samples: none of its tensors has {batch_size} rows in dim 0 (shapes {shapes})",
                hint="make batches(batch_size) yield (inputs, target) with batch_size samples "
                     "in both")

    def check_like_examples(self, inputs: Inputs, batch_size: int,
                            examples_at: int | None = None) -> None:
        """ModelFileError unless `inputs`, drawn from batches(batch_size), have what the plan was
        captured from, example_inputs at that size: the same arguments, tensor shapes and
        dtypes, and non-tensor values (export bakes those into the program, so a `scale=3.0`
        in the data would silently train with example_inputs' 2.0). With `examples_at`,
        example_inputs are made at that (smaller) size and tensors compared by dtype only: for
        a caller that checks the data's shapes against the plan itself (launch, per batch)."""
        at = batch_size if examples_at is None else examples_at
        problem = inputs_difference(inputs, self.inputs(at), shapes=examples_at is None)
        if problem:
            raise ModelFileError(
                f"batches({batch_size}) in {self.path} yields inputs unlike "
                f"example_inputs({at}): {problem}",
                hint="make batches(batch_size) yield the arguments example_inputs(batch_size) "
                     "gives, with their shapes and dtypes and the same non-tensor values")


_END = object()


# Lines a model file's import, build_model() or example_inputs() may print before the rest is
# dropped: a model that prints per layer must not bury partc's report (or a CI log).
PRINT_LINES = 20


class _BoundedPrints(io.TextIOBase):
    """sys.stdout while model code sets up: its first PRINT_LINES lines go to stderr (stdout is
    the command's report), the rest are counted."""

    def __init__(self, target: TextIO) -> None:
        self.target = target
        self.lines = 0
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            if self.lines < PRINT_LINES:
                self.target.write(piece)
            elif piece.endswith("\n"):
                self.dropped += 1
            if piece.endswith("\n"):
                self.lines += 1
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's OutOfMemoryError, a CPU allocation the OS refused
    (DefaultCPUAllocator's "can't allocate memory"), Python's MemoryError."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("can't allocate memory", "not enough memory", "out of memory"))


def _one_number(value: Any, where: str) -> torch.Tensor:
    """`value` if it is a floating tensor of one element (what backward() starts from), else a
    ModelFileError saying what loss_fn returned."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and \
            (value.is_floating_point() or value.is_complex()):
        return value
    if isinstance(value, torch.Tensor):
        what = f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    else:
        what = f"a {type(value).__name__}"
    raise ModelFileError(f"{where} returned {what}, not one floating-point number",
                         hint="return the loss reduced to a scalar tensor (e.g. .mean(), or "
                              "reduction='mean') that backward() can start from")


@contextlib.contextmanager
def model_code(where: str, when: str = "", hint: str = "pass --debug for the traceback",
               exceptions: bool = True, prints: bool | None = None,
               passes: Callable[[BaseException], bool] | None = None) -> Iterator[None]:
    """Run code of the user's model file: what it raises (Exception when `exceptions`, and
    always SystemExit and the other BaseExceptions: a model file must not end or fake the
    outcome of a partc command) becomes a ModelFileError naming `where`. KeyboardInterrupt
    passes (Ctrl-C), as does a PartcError, and an Exception for which `passes` is true. Set-up
    calls (`prints`, default: `exceptions`) print to stderr, at most PRINT_LINES lines."""
    bounded = _BoundedPrints(sys.stderr) if (exceptions if prints is None else prints) else None
    try:
        if bounded is None:
            yield
        else:
            with contextlib.redirect_stdout(bounded):
                yield
    except (KeyboardInterrupt, PartcError):
        raise
    except SystemExit as exc:
        raise ModelFileError(f"{where} called sys.exit({exc.code!r})"
                             + (f" {when}" if when else ""),
                             hint="model code must not exit the process; raise an exception "
                                  "instead") from exc
    except Exception as exc:
        if not exceptions or (passes is not None and passes(exc)):
            raise
        raise ModelFileError(f"{where} raised {summarize_exception(exc)}"
                             + (f" {when}" if when else ""), hint=hint) from exc
    except BaseException as exc:
        raise ModelFileError(f"{where} raised {type(exc).__name__}"
                             + (f" {when}" if when else ""),
                             hint="model code must raise Exception subclasses only") from exc
    finally:
        if bounded is not None and bounded.dropped:
            print(f"partc: {where} printed {bounded.dropped} more line(s), not shown",
                  file=sys.stderr)


def input_leaves(inputs: Inputs) -> list[tuple[str, Any]]:
    """The leaves of (args, kwargs) with where each sits: 'args[0]', "kwargs['mask']" (keyword
    arguments by name, whatever order they come in)."""
    args, kwargs = inputs
    found: list[tuple[str, Any]] = []
    for label, part in (("args", tuple(args)), ("kwargs", dict(sorted(kwargs.items())))):
        leaves, _ = pytree.tree_flatten_with_path(part)
        found += [(label + pytree.keystr(path), leaf) for path, leaf in leaves]
    return found


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return repr(value)[:60]


def inputs_difference(inputs: Inputs, examples: Inputs, shapes: bool = True) -> str:
    """How `inputs` differ from `examples` in what a captured program depends on (which
    arguments, tensor dtypes and, with `shapes`, shapes, non-tensor values), '' when they do
    not."""
    mine, theirs = dict(input_leaves(inputs)), dict(input_leaves(examples))
    extra, lacking = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
    if extra or lacking:
        return "; ".join(part for part in (
            f"{', '.join(extra)} not in example_inputs" if extra else "",
            f"no {', '.join(lacking)}" if lacking else "") if part)
    for name, value in mine.items():
        example = theirs[name]
        if isinstance(value, torch.Tensor) and isinstance(example, torch.Tensor):
            same = value.dtype == example.dtype and (not shapes or value.shape == example.shape)
        else:
            try:
                same = bool(value == example)  # 2 for 2.0: the same number to the program
            except Exception:  # a value whose == is no bool: compared by what it shows
                same = repr(value) == repr(example)
        if not same:
            return f"{name} is {_described(value)}, example_inputs gives {_described(example)}"
    return ""


def normalize_inputs(raw: Any, where: str = "example_inputs") -> Inputs:
    """(args, kwargs) from the accepted forms: tensor, tuple/list, dict, or (tuple, dict) pair."""
    if isinstance(raw, torch.Tensor):
        return (raw,), {}
    if isinstance(raw, dict):
        _check_keys(raw, where)
        return (), dict(raw)
    if isinstance(raw, (tuple, list)):
        if (len(raw) == 2 and isinstance(raw[0], (tuple, list)) and isinstance(raw[1], dict)):
            _check_keys(raw[1], where)
            return tuple(raw[0]), dict(raw[1])
        return tuple(raw), {}
    raise ModelFileError(
        f"{where} returned {type(raw).__name__}; expected a tuple of positional inputs, a dict of "
        "keyword inputs, or a (tuple, dict) pair", hint=_CONTRACT_HINT)


def _check_keys(kwargs: dict[Any, Any], where: str) -> None:
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise ModelFileError(f"{where} returned a dict with non-string keys {bad[:3]!r}",
                             hint="keyword inputs are keyed by the forward() argument names")


def _first_tensor(value: Any) -> torch.Tensor:
    leaves, _ = torch.utils._pytree.tree_flatten(value)
    # HF ModelOutput and similar dataclasses flatten through their registered pytree nodes.
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise ModelFileError("the model output contains no tensor",
                         hint="define loss_fn(output, target)")


def default_loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The loss used when the model file defines no loss_fn.

    Takes the first tensor of the output (its first field for tuples, dicts and HF ModelOutputs).
    A scalar is the model's own loss (an HF model given labels, CLIP with return_loss): it is
    the loss, whatever the target. Integer targets mean classification: cross-entropy over the
    last output dimension, with output and target flattened to [N, C] and [N] (so language
    models' [B, S, V] logits work). Floating targets mean regression: mean squared error.
    """
    out = _first_tensor(output)
    if out.dim() == 0:
        return out.float()
    if not target.is_floating_point():
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(),
                                                 target.reshape(-1).long())
    return torch.nn.functional.mse_loss(out.float(), target.float())


def synthetic_batches(model_file: ModelFile, batch_size: int, seed: int = 0,
                      output_shape: tuple[int, ...] | None = None
                      ) -> Iterator[tuple[Inputs, torch.Tensor]]:
    """Batches for a model file without batches(): its example_inputs plus synthetic targets.

    Every step re-draws floating-point inputs (standard normal) and integer inputs (uniform in
    [0, max+1) of the example's values) with a seeded CPU generator, keeping the example's shapes,
    dtypes, devices and any all-equal tensors (masks), at any nesting depth; the target is random
    int64 class indices in [0, C) shaped like the first output without its last dimension, C being
    that dimension, which matches `default_loss_fn`'s classification branch (synthetic data is
    always classification-shaped: define batches() for regression). The output shape comes from
    one forward pass without gradients, in the model's training mode; a meta-device model runs
    that pass on meta inputs, so nothing is materialised; a caller that knows the output shape
    (`output_shape`, e.g. from a plan) skips the pass. Deterministic for a given seed. A scalar
    first output is the model's own loss (`default_loss_fn`): the target is then a 0-d zero no
    loss reads.
    """
    args, kwargs = model_file.inputs(batch_size)
    gen = torch.Generator().manual_seed(seed)
    if output_shape is None:
        model = model_file.build().train()
        probe_args, probe_kwargs = args, kwargs
        if is_on_meta(model):
            model = model.to("meta")
            probe_args, probe_kwargs = inputs_to_meta((args, kwargs))
        with torch.no_grad():
            output_shape = tuple(_first_tensor(model(*probe_args, **probe_kwargs)).shape)
        del model
    if not output_shape:  # the model's own loss: a placeholder target no loss reads
        while True:
            new_args, new_kwargs = torch.utils._pytree.tree_map(_redrawn(gen), (args, kwargs))
            yield (tuple(new_args), dict(new_kwargs)), torch.zeros(())
    classes = output_shape[-1]
    target_shape = tuple(output_shape[:-1])

    redraw = _redrawn(gen)
    while True:
        new_args, new_kwargs = torch.utils._pytree.tree_map(redraw, (args, kwargs))
        target = torch.randint(0, classes, target_shape, generator=gen)
        yield (tuple(new_args), dict(new_kwargs)), target


def _redrawn(gen: torch.Generator) -> Callable[[Any], Any]:
    """Redraws an example tensor (synthetic_batches' docstring) from `gen`."""
    def redraw(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)
        lo, hi = int(t.min()), int(t.max())
        if lo == hi:
            return t.clone()
        return torch.randint(0, hi + 1, t.shape, generator=gen, dtype=t.dtype).to(t.device)
    return redraw


def is_on_meta(model: torch.nn.Module) -> bool:
    """True when any parameter or buffer lives on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def inputs_to_meta(inputs: Inputs) -> Inputs:
    """The same inputs with every tensor (at any nesting depth) moved to the meta device."""
    args, kwargs = inputs
    move = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    return (tuple(torch.utils._pytree.tree_map(move, list(args))),
            torch.utils._pytree.tree_map(move, kwargs))


class _SourceLoader(importlib.abc.SourceLoader):
    """Imports a module from bytes already read (and hashed) instead of re-opening the file."""

    def __init__(self, path: Path, source: bytes) -> None:
        self.path = path
        self.source = source

    def get_filename(self, fullname: str) -> str:
        return str(self.path)

    def get_data(self, path: str) -> bytes:
        if path != str(self.path):  # only the module's own source; no bytecode cache
            raise OSError(f"{path} is not the model file")
        return self.source


def load_model_file(path: str | Path, source: bytes | None = None) -> ModelFile:
    """Import a model file and check that it defines the contract's functions.

    The file is imported from the bytes read here (`source` when the caller read and checked
    them already, e.g. against a plan's sha256), never re-read; `ModelFile.sha256` is of those
    bytes.
    The file's directory is put on sys.path while it imports, so it can import its neighbours.
    Raises ModelFileError (one clear line) for a missing file, an import failure, a model file
    that calls sys.exit() while importing, or a missing function.
    """
    path = Path(path)
    if source is None:
        source = read_model_source(path)
    resolved = path.resolve()
    # A stable module name; a digest of the path only when another file already took the name.
    module_name = f"partc_model_{_identifier(path.stem)}"
    previous = sys.modules.get(module_name)
    if previous is not None and getattr(previous, "__file__", None) != str(resolved):
        module_name += "_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    loader = _SourceLoader(resolved, source)
    spec = importlib.util.spec_from_loader(module_name, loader, origin=str(resolved))
    if spec is None:
        raise ModelFileError(f"cannot import {path} as Python", hint="pass a .py file")
    spec.has_location = True  # __file__ is the model file (inspect, tracebacks, dataclasses)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(resolved.parent))
    try:
        with model_code(f"model file {path}", "while importing", exceptions=False, prints=True):
            loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[module_name]
        raise syntax_error(path, exc) from exc
    except Exception as exc:
        del sys.modules[module_name]
        if isinstance(exc, PartcError):
            raise
        raise ModelFileError(
            f"model file {path} raised {summarize_exception(exc)} while importing",
            hint=f"run `python {path}` to see the full traceback, or pass --debug") from exc
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        # First on the path while the file imports (as `python model.py` would have it); then
        # moved to the end, so imports deferred into build_model() still find the neighbours
        # without the file's directory shadowing installed packages for the rest of the process.
        if str(resolved.parent) in sys.path:  # the file may have edited sys.path itself
            sys.path.remove(str(resolved.parent))
        if str(resolved.parent) not in sys.path:
            sys.path.append(str(resolved.parent))

    def function(name: str, required: bool) -> Callable[..., Any] | None:
        fn = getattr(module, name, None)
        if fn is None:
            if required:
                raise ModelFileError(f"model file {path} does not define {name}()",
                                     hint=_CONTRACT_HINT)
            return None
        if not callable(fn):
            raise ModelFileError(f"{name} in {path} is a {type(fn).__name__}, not a function",
                                 hint=_CONTRACT_HINT)
        return fn

    return ModelFile(
        path=path,
        sha256=hashlib.sha256(source).hexdigest(),
        module=module,
        module_name=module_name,
        build_model=function("build_model", True),  # type: ignore[arg-type]
        example_inputs=function("example_inputs", True),  # type: ignore[arg-type]
        loss_fn=function("loss_fn", False),
        batches=function("batches", False),
    )


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text) or "model"
