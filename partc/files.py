"""Files partc writes and checks: one atomic write, one content hash, one YAML reader.

Every file partc writes (plan.yaml, stage files, checkpoints, profiles, OpGraph files, reports)
goes through `write_atomic`: a reader, a concurrent `partc check` or a process killed half-way
sees the old file or the new one, never half of one. Every YAML file partc reads (plans,
profiles, device and cluster configs) goes through `load_yaml`, whose only error is a
yaml.YAMLError.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable, Union

import yaml

Content = Union[str, bytes, Callable[[BinaryIO], object]]


def write_atomic(path: str | Path, content: Content) -> Path:
    """Write `path` whole or not at all, and return it.

    `content` is text (UTF-8), bytes, or a function that writes to a binary file object (e.g.
    `lambda f: torch.save(state, f)`). It goes to a temporary file beside `path` (the same
    directory, so the rename is atomic; a unique name, so concurrent writers do not collide),
    which is flushed to disk and renamed over `path`; then the directory entry is flushed, so a
    crash right after the call cannot lose the file. On any failure, KeyboardInterrupt included,
    the temporary file is removed and `path` is untouched; OSError (a full disk, permissions)
    propagates for the caller to turn into a user error.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # O_EXCL: never write through a file (or link) someone else put at the temporary name.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            if isinstance(content, str):
                f.write(content.encode())
            elif isinstance(content, bytes):
                f.write(content)
            else:
                content(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a filesystem that cannot open directories: nothing to flush
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def probe_writable(directory: str | Path) -> None:
    """Create and remove a uniquely named file in `directory`; OSError if it cannot be (a
    read-only directory or filesystem, whatever its mode bits say to root)."""
    probe = Path(directory) / f".partc-probe-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    probe.unlink()


def _refuse_repeated_keys(loader: yaml.constructor.BaseConstructor,
                         node: yaml.MappingNode) -> None:
    """A ConstructorError where a mapping repeats a key. YAML says keys are unique, and PyYAML
    keeps the last of repeated ones silently: a plan.yaml whose reviewer reads one
    `num_microbatches:` while partc runs the other is what reviewing plans is there to prevent.
    Keys a merge (`<<: *base`) brings may be overridden, as YAML allows."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            repeated = key in seen
        except TypeError:  # unhashable: the constructor refuses it as PyYAML does
            return
        if repeated:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"key {key!r} appears twice",
                key_node.start_mark)
        seen.add(key)


class _RefusingRepeatedKeys:
    """A loader mixin: mappings built through `_refuse_repeated_keys`."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _refuse_repeated_keys(self, node)  # type: ignore[arg-type]
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _UniqueKeyLoader(_RefusingRepeatedKeys, yaml.SafeLoader):
    """yaml.SafeLoader that refuses repeated keys."""


_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _FastUniqueKeyLoader(_RefusingRepeatedKeys, _FAST_LOADER):  # type: ignore[misc, valid-type]
    """libyaml's parser where built (else PyYAML's), refusing repeated keys alike."""


def load_yaml(text: str, fast: bool = False) -> Any:
    """YAML text as data (yaml.SafeLoader; `fast`: libyaml's C one where built, for profiles).
    A document no partc file is fails as a yaml.YAMLError like any malformed one, so the
    callers' one-line errors cover it: a key repeated in one mapping (`_refuse_repeated_keys`), an
    integer of more digits than Python converts, or a date that is no date (ValueError), or
    nesting deeper than the pure-Python parser recurses (RecursionError). Both were internal
    errors (exit 3) of `partc check` on such a plan.yaml."""
    try:
        loader = _FastUniqueKeyLoader if fast else _UniqueKeyLoader
        return yaml.load(text, Loader=loader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except ValueError as exc:
        # int()'s digit-limit message ends in advice for Python programmers: cut it there
        raise yaml.YAMLError(f"a value that cannot be read: {str(exc).split(';')[0]}") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What `load_yaml` found wrong, on one line: 'at line L, column C: problem'."""
    mark = getattr(exc, "problem_mark", None)
    at = f"at line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())[:200]
    return at + problem


_SPECIAL_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                  (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def special_file(path: str | Path) -> str:
    """What `path` is when it exists and is neither a regular file nor a directory ('a named
    pipe'), else ''. Reading a named pipe waits for a writer, forever: readers of the files a
    user names check this first."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    return next((kind for test, kind in _SPECIAL_KINDS if test(mode)), "")


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
