"""A weights file a user hands partc (`launch --init-from`, `verify --init-from`), read as the
model names its tensors.

What is read, by its first bytes, not its name:

- torch.save's zip format (memory-mapped: a process reads only its stage's tensors) and its
  legacy format (read whole: it cannot be mapped);
- safetensors (Hugging Face's `model.safetensors`), opened lazily: a tensor is read when asked;
- a sharded Hugging Face checkpoint's index (`model.safetensors.index.json`,
  `pytorch_model.bin.index.json`): its `weight_map` names the shard holding each tensor, each
  shard opened (lazily) when one of its tensors is first asked for.

A torch.save'd dict is a state dict (every value a tensor) or a training checkpoint holding one
under one of `CONTAINER_KEYS` (`{'model_state_dict': ..., 'optimizer_state_dict': ..., 'epoch':
...}`).

Its names are matched to the model's (`for_model`): a state dict saved through a wrapper carries
the wrapper's prefix on every name (`module.` from DataParallel/DistributedDataParallel,
`_orig_mod.` from torch.compile, `model.` from a Hugging Face head around the base model the plan
was compiled from). When the model's names are not all there as they are, and every one of them
is there under one prefix, that prefix is read away, and the caller says so; two prefixes that
both fit are refused as ambiguous rather than guessed.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from partc.errors import PartcError

# where training scripts commonly keep the model's state dict inside a checkpoint dict
CONTAINER_KEYS = ("model", "state_dict", "model_state_dict", "module")
# what a few prefixes come from, for the note that reports reading one away
_PREFIX_SOURCES = {"module.": "DataParallel/DistributedDataParallel",
                   "_orig_mod.": "torch.compile", "module._orig_mod.": "DDP around torch.compile",
                   "_orig_mod.module.": "torch.compile around DDP"}
_SAVE_HINT = "pass a file written by torch.save(model.state_dict(), path), or a safetensors file"


class WeightsError(PartcError):
    """A weights file cannot be read, or does not hold the model's tensors."""


def _kind(path: Path) -> str:
    """'torch' (zip or legacy pickle), 'safetensors', 'index' (a JSON shard index), by content."""
    with open(path, "rb") as f:
        head = f.read(9)
    # torch.save writes a zip archive, or (legacy format) a pickle, whose first byte is PROTO
    if head.startswith((b"PK\x03\x04", b"\x80")):
        return "torch"
    # safetensors: an 8-byte little-endian header length, then the JSON header itself
    if len(head) == 9 and head[8:9] == b"{":
        (length,) = struct.unpack("<Q", head[:8])
        if 0 < length < path.stat().st_size:
            return "safetensors"
        raise WeightsError(f"weights file {path} is a safetensors file whose {length}-byte "
                           f"header runs past the file's end ({path.stat().st_size} bytes)",
                           hint="the file is truncated: download or save it again")
    if head.lstrip()[:1] == b"{":
        return "index"
    raise WeightsError(f"weights file {path} is not a file torch.save writes, a safetensors "
                       f"file or a checkpoint index (it begins {head[:4]!r})", hint=_SAVE_HINT)


def _torch_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        try:
            data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:
            if "_use_new_zipfile_serialization" not in str(exc):
                raise
            # torch.save's legacy format (before torch 1.6, or asked for) cannot be mapped: read
            # whole; a file that is no torch.save output at all fails here, with its own reason
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise WeightsError(f"cannot load weights file {path}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}",
                           hint=_SAVE_HINT) from exc
    return _state_dict_in(data, path)


def _is_state_dict(data: Any) -> bool:
    return isinstance(data, dict) and bool(data) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items())


def _state_dict_in(data: Any, path: Path) -> dict[str, torch.Tensor]:
    """The state dict itself, or the one a training checkpoint holds under a CONTAINER_KEYS key."""
    if _is_state_dict(data):
        return data
    if isinstance(data, dict):
        inner = [k for k in CONTAINER_KEYS if _is_state_dict(data.get(k))]
        if inner:
            return data[inner[0]]
        keys = ", ".join(sorted(str(k) for k in data)[:6])
        raise WeightsError(f"weights file {path} is not a state dict of tensors (its keys: "
                           f"{keys or 'none'}), nor holds one under "
                           f"{'/'.join(repr(k) for k in CONTAINER_KEYS)}", hint=_SAVE_HINT)
    raise WeightsError(f"weights file {path} holds a {type(data).__name__}, not a state dict",
                       hint=_SAVE_HINT)


class _LazyState(Mapping[str, torch.Tensor]):
    """Tensors by name, each read from its file when first asked for (one open per file)."""

    def __init__(self, where: dict[str, Path], reader: Callable[[Path], Any]) -> None:
        self._where = where  # tensor name -> the file that holds it
        self._reader = reader
        self._open: dict[Path, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._where[name]
        if path not in self._open:
            self._open[path] = self._reader(path)
        value = self._open[path]
        try:
            return value[name] if isinstance(value, Mapping) else value.get_tensor(name)
        except Exception as exc:
            raise WeightsError(f"cannot read {name} from weights file {path}: "
                               f"{type(exc).__name__}: {exc}", hint=_SAVE_HINT) from exc

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where


def _safe_open(path: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise WeightsError(f"weights file {path} is a safetensors file, and the safetensors "
                           "package is not installed", hint="pip install safetensors") from None
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:
        raise WeightsError(f"cannot open safetensors file {path}: {type(exc).__name__}: {exc}",
                           hint="the file is truncated or not a safetensors file") from None


def _safetensors_file(path: Path) -> _LazyState:
    handle = _safe_open(path)
    return _LazyState({name: path for name in handle.keys()}, lambda _: handle)


def _index_file(path: Path) -> _LazyState:
    """A sharded checkpoint's index: {"weight_map": {tensor name: shard file name}}."""
    try:
        index = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"weights file {path} is neither torch.save output nor a JSON "
                           f"checkpoint index ({exc})", hint=_SAVE_HINT) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise WeightsError(f"{path} is JSON but no checkpoint index (no \"weight_map\" of tensor "
                           "names to shard files)", hint="pass the model.safetensors.index.json "
                           "(or pytorch_model.bin.index.json) of a sharded checkpoint")
    for name in sorted(set(weight_map.values())):
        # by name, not by resolved path: a Hugging Face cache's shards are links into blobs/
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise WeightsError(f"{path} names shard {name!r} outside its own directory",
                               hint="an index lists shard files beside it")
    shards = {name: (path.parent / shard) for name, shard in weight_map.items()}
    for shard in sorted(set(shards.values())):
        if not shard.is_file():
            raise WeightsError(f"{path} names shard {shard.name}, which is not a file",
                               hint="download every shard the index lists next to it")

    def read(shard: Path) -> Any:
        kind = _kind(shard)
        if kind == "safetensors":
            return _safe_open(shard)
        if kind == "torch":
            return _torch_file(shard)
        raise WeightsError(f"shard {shard} is itself an index", hint=_SAVE_HINT)
    return _LazyState(shards, read)


def read_weights_file(path: str | Path) -> Mapping[str, torch.Tensor]:
    """The tensors of a weights file by the names it stores them under (module docstring); big
    files are mapped or read lazily, not loaded whole."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} not found", hint=_SAVE_HINT)
    kind = _kind(path)
    if kind == "torch":
        return _torch_file(path)
    if kind == "safetensors":
        return _safetensors_file(path)
    return _index_file(path)


class _Prefixed(Mapping[str, torch.Tensor]):
    """`state` with `prefix` read away from its names (names without it are left out)."""

    def __init__(self, state: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._state = state
        self._prefix = prefix
        self._names = [k[len(prefix):] for k in state if k.startswith(prefix)]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._state[self._prefix + name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._prefix + name in self._state


@dataclass(frozen=True)
class ModelWeights:
    """A weights file's tensors, named as the model names them."""

    state: Mapping[str, torch.Tensor]
    prefix: str  # read away from every stored name ('' when the names were the model's)

    def note(self, where: str) -> str | None:
        """The line that says a prefix was read away, or None."""
        if not self.prefix:
            return None
        source = _PREFIX_SOURCES.get(self.prefix)
        return (f"{where} stores the model's tensors under the prefix {self.prefix!r}"
                + (f" (a {source} wrapper's)" if source else "") + "; read without it")


def for_model(state: Mapping[str, torch.Tensor], names: Iterable[str],
              aliases: Mapping[str, Iterable[str]], where: str) -> ModelWeights:
    """`state` named as the model names its tensors `names` (any alias of a tied tensor counts):
    as stored when every name is there, else with the one prefix under which the most names are
    there read away, when that finds more than the stored names do. Two prefixes that find as
    many: WeightsError (ambiguous). Names still missing are the caller's to report
    (`stored_names`)."""
    wanted = sorted(set(names))
    spellings = {n: (n, *aliases.get(n, ())) for n in wanted}

    def found(prefix: str) -> int:
        return sum(any(prefix + s in state for s in spelt) for spelt in spellings.values())

    direct = found("")
    if direct == len(wanted):
        return ModelWeights(state, "")
    missing = {s for n, spelt in spellings.items() for s in spelt
               if not any(x in state for x in spelt)}
    # every whole-segment prefix of a stored name whose rest is a missing name
    candidates: set[str] = set()
    for key in state:
        cut = key.find(".")
        while cut != -1:
            if key[cut + 1:] in missing:
                candidates.add(key[:cut + 1])
            cut = key.find(".", cut + 1)
    counts = sorted(((found(p), p) for p in candidates), key=lambda c: (-c[0], c[1]))
    if not counts or counts[0][0] <= direct:
        return ModelWeights(state, "")
    best = [p for count, p in counts if count == counts[0][0]]
    if len(best) > 1:
        raise WeightsError(f"{where} holds the model's tensors under {len(best)} prefixes "
                           f"({', '.join(repr(p) for p in best[:3])}); which one is meant is not "
                           "clear", hint="save the state_dict of the model the plan was compiled "
                                         "from: torch.save(model.state_dict(), path)")
    return ModelWeights(_Prefixed(state, best[0]), best[0])
