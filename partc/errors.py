"""Errors a user can cause. The CLI prints them as one line with a hint and exits non-zero."""
from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A stage file's (TorchScript's) errors: this header, the script's traceback, then the error
_TORCHSCRIPT_FAILED = "The following operation failed in the TorchScript interpreter"
_ERROR_LINE = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception): (.+)")


class PartcError(Exception):
    """Base of every error caused by user input (files, flags, models), never by a partc bug."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = " ".join(self.message.split())
        return f"{text} (hint: {self.hint})" if self.hint else text


class ModelFileError(PartcError):
    """The model file is missing, does not import, or breaks the model-file contract."""


class CaptureError(PartcError):
    """torch.export could not capture the model, or it produced something partc cannot use."""


class GraphFileError(PartcError):
    """An OpGraph file is missing, malformed, or from another format version."""


class MemoryConfigError(PartcError):
    """A training configuration or schedule parameter the memory model cannot price."""


class SearchError(PartcError):
    """Options the search cannot honour (a pinned shape that does not exist on the cluster)."""


class LaunchError(PartcError):
    """A launch that cannot start or continue: bad options, world size, environment."""


class StageFileError(PartcError):
    """A stage file that does not load in this process (an operator no imported library
    registers)."""


def summarize_exception(exc: BaseException, limit: int = 300) -> str:
    """The most useful single line of an exception: the innermost cause's first non-empty line.

    torch.export wraps the real reason in several layers of multi-line messages; users want the
    reason, e.g. "Found <class 'DynamicCache'> in output, which is not a known type".
    """
    inner = exc
    seen = {id(inner)}
    while inner.__cause__ is not None and id(inner.__cause__) not in seen:
        inner = inner.__cause__
        seen.add(id(inner))
    text = ""
    for candidate in (inner, exc):
        lines = [ln.strip() for ln in _ANSI.sub("", str(candidate)).splitlines() if ln.strip()]
        if lines and lines[0].startswith(_TORCHSCRIPT_FAILED):
            # the TorchScript traceback comes first; its last error line is the reason
            raised = [m.group(1) for m in map(_ERROR_LINE.match, lines) if m]
            text = raised[-1] if raised else lines[-1]
        elif lines:
            text = lines[0]
        if text:
            break
    text = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
