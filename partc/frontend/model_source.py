"""Reading a model file's source, torch-free: the checks that need no import of the model (a
missing file, a directory, an unreadable file, a syntax error), so the CLI can refuse a bad model
path in a fraction of a second instead of after seconds of importing torch.

partc.frontend.model_file imports the model from these bytes; this module never executes them.
"""
from __future__ import annotations

from pathlib import Path

from partc.errors import ModelFileError
from partc.files import special_file

_PATH_HINT = ("pass the path of a .py file that defines build_model() and "
              "example_inputs(batch_size)")


def read_model_source(path: str | Path) -> bytes:
    """The model file's bytes. Raises ModelFileError (one line with a hint) when the path is
    missing, a directory or unreadable."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}", hint=_PATH_HINT)
    if path.is_dir():
        raise ModelFileError(f"model file {path} is a directory",
                             hint="pass the path of a .py file")
    kind = special_file(path)
    if kind:  # a named pipe would wait for a writer forever; a plan records a file's hash
        raise ModelFileError(f"model file {path} is {kind}, not a file",
                             hint="pass the path of a .py file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}",
                             hint="check the file's permissions") from exc


def check_model_syntax(path: str | Path, source: bytes) -> None:
    """Compile (never run) the source: a syntax error is the same one line the import would
    give, without importing anything first."""
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise syntax_error(path, exc) from exc
    except ValueError as exc:  # source with NUL bytes
        raise ModelFileError(f"model file {path} is not Python source: {exc}",
                             hint="pass a .py file") from exc


def syntax_error(path: str | Path, exc: SyntaxError) -> ModelFileError:
    """The one-line error for a model file's syntax error."""
    if exc.lineno is None:  # NUL bytes: a binary file, no line to name
        return ModelFileError(f"model file {path} is not Python source: {exc.msg}",
                              hint="pass a .py file")
    return ModelFileError(f"model file {path} has a syntax error at line {exc.lineno}: {exc.msg}",
                          hint="fix the file; `python -m py_compile FILE` shows the same")


def refuse_bad_model_source(path: str | Path) -> None:
    """Fail fast on a model path that cannot be a model file (see the module docstring)."""
    check_model_syntax(path, read_model_source(path))


__all__ = ["check_model_syntax", "read_model_source", "refuse_bad_model_source", "syntax_error"]
