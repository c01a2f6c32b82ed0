"""Device and cluster configs: the YAML files of configs/ (shipped with the package) -> specs.

A device (`configs/devices/<name>.yaml`) and a cluster (`configs/clusters/<name>.yaml`) are read
into frozen `DeviceSpec` and `ClusterSpec` (partc.hardware.specs); quantities may carry units
(partc.hardware.units). Every problem in a config file is a `ConfigError` naming the file and the
key, with a hint. The format is documented in docs/hardware.md.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

import yaml

from partc.errors import PartcError
from partc.files import load_yaml, yaml_problem
from partc.hardware.specs import (
    BACKENDS,
    DEVICE_KINDS,
    DTYPES,
    OP_CLASSES,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    speed_modes_problem,
    vector_bytes_problem,
)
from partc.hardware.units import UNIT_EXAMPLES, parse_quantity

# Common short names, for hints only: the keys themselves are torch's names.
_DTYPE_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
                  "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8"}


class ConfigError(PartcError):
    """A device or cluster config is missing, unreadable, or breaks the schema."""


_UNITS_HINT = "see docs/hardware.md for the keys and units"


def _fail(where: str, key: str, problem: str, hint: str = _UNITS_HINT) -> NoReturn:
    location = f"{where}: key '{key}'" if key else where
    raise ConfigError(f"{location}: {problem}", hint)


class _Mapping:
    """Reads the keys of one YAML mapping, remembering which were read to flag unknown ones."""

    def __init__(self, data: Any, where: str, path: str = "") -> None:
        if not isinstance(data, Mapping):
            what = "the file" if not path else "the value"
            _fail(where, path, f"{what} must be a mapping of keys to values, got "
                  f"{_type_name(data)}", hint="write `key: value` lines; " + _UNITS_HINT)
        self.data, self.where, self.path = data, where, path
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str, required: bool = True, default: Any = None) -> Any:
        self.seen.add(name)
        if name not in self.data or self.data[name] is None:
            if required:
                _fail(self.where, self.key(name), "missing",
                      hint=f"add `{name}:`; " + _UNITS_HINT)
            return default
        return self.data[name]

    def quantity(self, name: str, unit: str, *, positive: bool = True, at_most: float | None = None,
                 required: bool = True, default: float | None = None) -> float:
        value = self.raw(name, required, default)
        if value is None:
            return default  # type: ignore[return-value]
        return _checked_quantity(value, unit, self.where, self.key(name), positive, at_most)

    def integer(self, name: str, required: bool = True, default: int | None = None) -> int:
        value = self.raw(name, required, default)
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(self.where, self.key(name), f"expected a whole number, got {value!r}")
        if value < 1:
            _fail(self.where, self.key(name), f"must be at least 1, got {value}")
        return value

    def string(self, name: str, required: bool = True, default: str = "",
               choices: Sequence[str] | None = None) -> str:
        value = self.raw(name, required, default)
        if not isinstance(value, str):
            _fail(self.where, self.key(name), f"expected a string, got {value!r}")
        if choices is not None and value not in choices:
            _fail(self.where, self.key(name), f"{value!r} is not one of {', '.join(choices)}",
                  hint=_suggest(value, choices) or _UNITS_HINT)
        return value

    def label(self, name: str) -> str:
        """A required name shown in plans and every prediction's lines: one line of text."""
        value = self.string(name)
        if not value.strip() or not value.isprintable():
            _fail(self.where, self.key(name), f"expected a name on one line, got {value!r}",
                  hint="name it like its file, e.g. 'h100-80gb'")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name, False, default)
        if not isinstance(value, bool):
            _fail(self.where, self.key(name), f"expected true or false, got {value!r}")
        return value

    def sub(self, name: str, required: bool = True) -> "_Mapping | None":
        value = self.raw(name, required)
        return None if value is None else _Mapping(value, self.where, self.key(name))

    def finish(self) -> None:
        """Unknown keys are errors: a typo would otherwise silently fall back to a default."""
        for name in self.data:
            if name not in self.seen:
                known = sorted(self.seen)
                _fail(self.where, self.key(str(name)), "unknown key",
                      hint=_suggest(str(name), known) or f"known keys: {', '.join(known)}")


def _checked_quantity(value: Any, unit: str, where: str, key: str, positive: bool = True,
                      at_most: float | None = None) -> float:
    try:
        number = parse_quantity(value, unit)
    except ValueError as exc:
        _fail(where, key, str(exc), hint=f"write {UNIT_EXAMPLES[unit]}; {_UNITS_HINT}")
    if positive and not number > 0:
        _fail(where, key, f"must be positive, got {value!r}")
    if not positive and number < 0:
        _fail(where, key, f"must not be negative, got {value!r}")
    if at_most is not None and number > at_most:
        _fail(where, key, f"must be at most {at_most:g}, got {value!r}",
              hint="efficiencies are fractions of the peak, in (0, 1]")
    low, high = _PLAUSIBLE[unit]
    if number != 0 and not low <= number <= high:
        _fail(where, key, f"{value!r} is outside what any device or link has ({low:g} to {high:g} "
                          f"{unit or '(a fraction)'})", hint=f"write {UNIT_EXAMPLES[unit]}")
    return number


# What a device or link can have, per unit (a nonzero value outside is a typo or a hostile
# file): an overhead of 1e300 s made compile overflow converting costs to the solver's integers
# (exit 3), and a bandwidth of 1e-300 B/s wrote a plan predicting 6e306 s per iteration.
_PLAUSIBLE: dict[str, tuple[float, float]] = {
    "B": (1.0, float(2**60)),  # up to 1 EiB
    "B/s": (1.0, 1e18),
    "FLOP/s": (1.0, 1e21),
    "s": (1e-12, 3600.0),  # an overhead or latency: a picosecond to an hour
    "": (1e-6, 1e6),  # fractions (efficiencies) and plain factors
}


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def _type_name(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number",
            type(None): "nothing (empty file?)"}.get(type(value), type(value).__name__)


def device_from_dict(d: dict[str, Any], where: str) -> DeviceSpec:
    """A DeviceSpec from a parsed YAML mapping (or `DeviceSpec.to_dict()`); `where` names the
    file for error messages. Raises ConfigError."""
    return _device_from(_Mapping(d, where))


def _device_from(m: _Mapping) -> DeviceSpec:
    where = m.where
    name = m.label("name")
    kind = m.string("kind", choices=DEVICE_KINDS)
    memory = m.quantity("memory_bytes", "B")
    peaks_in = m.sub("peak_flops")
    assert peaks_in is not None
    peaks: dict[str, float] = {}
    for dtype in peaks_in.data:
        _known_dtype(peaks_in, dtype)
        peaks[dtype] = peaks_in.quantity(dtype, "FLOP/s")
    if "float32" not in peaks:
        _fail(where, peaks_in.key("float32"), "missing",
              hint="every device needs a float32 peak; other dtypes fall back to it")
    eff_in = m.sub("efficiency")
    assert eff_in is not None
    for op_class in eff_in.data:
        if op_class not in OP_CLASSES:
            _fail(where, eff_in.key(str(op_class)), "unknown op class",
                  hint=_suggest(str(op_class), OP_CLASSES) or f"classes: {', '.join(OP_CLASSES)}")
    efficiency = {c: eff_in.quantity(c, "", at_most=1.0) for c in OP_CLASSES}
    vector = m.raw("vector_bytes", required=False, default=0)
    if (problem := vector_bytes_problem(vector, kind)) is not None:
        _fail(where, m.key("vector_bytes"), problem,
              hint="a CPU's SIMD register width in bytes: 64 AVX-512, 32 AVX2, 16 SSE or NEON "
                   "(docs/hardware.md)")
    spread = _speed_spread_from(m)
    spec = DeviceSpec(
        name=name,
        kind=kind,
        memory_bytes=int(round(memory)),
        peak_flops={k: peaks[k] for k in sorted(peaks)},
        memory_bandwidth=m.quantity("memory_bandwidth", "B/s"),
        efficiency=efficiency,
        bandwidth_efficiency=m.quantity("bandwidth_efficiency", "", at_most=1.0),
        op_overhead_s=m.quantity("op_overhead_s", "s", positive=False),
        backward_op_overhead_s=m.quantity("backward_op_overhead_s", "s", positive=False,
                                          required=False),
        microbatch_overhead_s=m.quantity("microbatch_overhead_s", "s", positive=False,
                                         required=False, default=0.0),
        cold_pass_s=m.quantity("cold_pass_s", "s", positive=False, required=False, default=0.0),
        p2p_post_cpu_s=m.quantity("p2p_post_cpu_s", "s", positive=False, required=False,
                                  default=0.0),
        dispatch_overhead_s=m.quantity("dispatch_overhead_s", "s", positive=False,
                                       required=False),
        cache_bytes=int(round(m.quantity("cache_bytes", "B", positive=False, required=False,
                                         default=0.0))),
        cache_bandwidth=m.quantity("cache_bandwidth", "B/s", positive=False, required=False,
                                   default=0.0),
        step_cold_s=m.quantity("step_cold_s", "s", positive=False, required=False, default=0.0),
        description=m.string("description", required=False),
        source=m.string("source", required=False),
        allow_tf32=m.boolean("allow_tf32", False),
        calibrated_on=m.string("calibrated_on", required=False),
        checked_against=m.string("checked_against", required=False),
        vector_bytes=vector,
        speed_spread=spread,
        speed_reference_s=_speed_reference_from(m),
    )
    m.finish()
    return spec


def _speed_spread_from(m: _Mapping) -> dict[str, tuple[tuple[float, float], ...]]:
    """`speed_spread:` (optional): dtype -> [[probability, factor], ...] (DeviceSpec)."""
    raw = m.raw("speed_spread", required=False, default={})
    hint = ("speed_spread maps a dtype to [[probability, factor], ...] whose probabilities sum "
            "to 1 and whose weighted factor is 1; `partc calibrate` measures it "
            "(docs/hardware.md)")
    if not isinstance(raw, dict):
        _fail(m.where, m.key("speed_spread"), f"must be a mapping, not {_type_name(raw)}", hint)
    spread: dict[str, tuple[tuple[float, float], ...]] = {}
    keys = _Mapping(raw, m.where, m.key("speed_spread"))
    for dtype, modes in raw.items():
        where = keys.key(str(dtype))
        _known_dtype(keys, dtype)
        if (problem := speed_modes_problem(modes)) is not None:
            _fail(m.where, where, problem, hint)
        spread[dtype] = tuple((float(p), float(f)) for p, f in modes)
    return spread


def _speed_reference_from(m: _Mapping) -> dict[str, float]:
    """`speed_reference_s:` (optional): dtype -> seconds of one call of the speed spread's
    matmul at the spread's mean speed (DeviceSpec.speed_reference_s)."""
    refs = m.sub("speed_reference_s", required=False)
    if refs is None:
        return {}
    found: dict[str, float] = {}
    for dtype in refs.data:
        _known_dtype(refs, dtype)
        found[dtype] = refs.quantity(dtype, "s")
    return found


def _known_dtype(m: _Mapping, dtype: object) -> None:
    """Fail on a key of `m` that is not a dtype partc prices (with the alias meant)."""
    if dtype not in DTYPES:
        alias = _DTYPE_ALIASES.get(str(dtype).lower())
        _fail(m.where, m.key(str(dtype)), "unknown dtype",
              hint=(f"did you mean '{alias}'?" if alias else _suggest(str(dtype), DTYPES))
              or f"dtypes: {', '.join(DTYPES)}")


def _link_from(m: _Mapping) -> LinkSpec:
    link = LinkSpec(bandwidth=m.quantity("bandwidth", "B/s"),
                    latency_s=m.quantity("latency_s", "s", positive=False))
    m.finish()
    return link


def cluster_from_dict(d: dict[str, Any], where: str) -> ClusterSpec:
    """A ClusterSpec from a parsed YAML mapping (or `ClusterSpec.to_dict()`). Raises ConfigError.

    `device` is a device name, a path to a device file (relative to the cluster file), or an
    inline device mapping. A name is looked up in the `devices/` folder beside the cluster file's
    folder (when `where` is a file in a `clusters/` folder), then in `config_dir()/devices`.
    `device_memory_bytes` overrides the device's memory_bytes (e.g. measured free memory).
    """
    m = _Mapping(d, where)
    name = m.label("name")
    device_value = m.raw("device")
    if isinstance(device_value, Mapping):
        device = _device_from(_Mapping(device_value, where, "device"))
    elif isinstance(device_value, str):
        device = _device_of_cluster(device_value, where)
    else:
        _fail(where, "device", f"expected a device name or a mapping, got {device_value!r}",
              hint=f"devices: {', '.join(list_devices())}")
    if m.has("device_memory_bytes"):
        device = replace(device, memory_bytes=int(round(m.quantity("device_memory_bytes", "B"))))
    num_nodes = m.integer("num_nodes")
    intra = m.sub("intra_node")
    assert intra is not None
    intra_link = _link_from(intra)
    inter = m.sub("inter_node", required=num_nodes > 1)
    # One node never uses the inter-node link; an omitted one is stored as the intra link.
    inter_link = _link_from(inter) if inter is not None else intra_link
    backend = m.string("backend", choices=BACKENDS)
    if backend == "nccl" and device.kind != "cuda":
        _fail(where, "backend", f"nccl needs a cuda device, but device '{device.name}' is "
              f"{device.kind}", hint="use backend: gloo for cpu devices")
    spec = ClusterSpec(
        name=name,
        device=device,
        devices_per_node=m.integer("devices_per_node"),
        num_nodes=num_nodes,
        intra_node=intra_link,
        inter_node=inter_link,
        backend=backend,
        description=m.string("description", required=False),
        source=m.string("source", required=False),
        cores_per_node=m.integer("cores_per_node") if m.has("cores_per_node") else None,
        wake_credit_s=m.quantity("wake_credit_s", "s", positive=False, required=False,
                                 default=0.0),
    )
    m.finish()
    return spec


def _device_of_cluster(ref: str, where: str) -> DeviceSpec:
    cluster_file = Path(where)
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        path = Path(ref)
        if not path.is_absolute() and cluster_file.is_file():
            path = cluster_file.parent / path
        return _load_device_file(path)
    candidates = []
    if cluster_file.is_file():
        candidates.append(cluster_file.resolve().parent.parent / "devices" / f"{ref}.yaml")
    candidates.append(config_dir() / "devices" / f"{ref}.yaml")
    for path in candidates:
        if path.is_file():
            return _load_device_file(path)
    _fail(where, "device", f"unknown device '{ref}'",
          hint=_available_hint(ref, list_devices(), "devices"))


# --------------------------------------------------------------------------------------------
# Files

def config_dir() -> Path:
    """The configs folder: $PARTC_CONFIG_DIR if set, else the configs shipped with partc.

    An installed wheel carries them as package data (partc/configs); in a source checkout, where
    the repository keeps them in its top-level configs/ beside partc/, that folder."""
    env = os.environ.get("PARTC_CONFIG_DIR")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parent.parent  # partc/
    shipped = package / "configs"
    return shipped if shipped.is_dir() else package.parent / "configs"


def _names(sub: str) -> list[str]:
    folder = config_dir() / sub
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def list_devices() -> list[str]:
    """Names of the devices in config_dir()/devices (file stems), sorted."""
    return _names("devices")


def list_clusters() -> list[str]:
    """Names of the clusters in config_dir()/clusters (file stems), sorted."""
    return _names("clusters")


def _available_hint(name: str, names: list[str], what: str) -> str:
    suggestion = _suggest(name, names)
    listing = f"available {what}: {', '.join(names)}" if names else f"no {what} in {config_dir()}"
    return f"{suggestion + ' ' if suggestion else ''}{listing}; or pass a path to a .yaml file"


def _resolve(name_or_path: str | Path, sub: str) -> Path:
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or text.endswith((".yaml", ".yml")) or os.sep in text \
            or "/" in text:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"{sub[:-1]} file not found: {path}",
                              _available_hint(path.stem, _names(sub), sub))
        return path
    path = config_dir() / sub / f"{text}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown {sub[:-1]} '{text}' (no {path})",
                          _available_hint(text, _names(sub), sub))
    return path


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", "check the path") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file ({exc.reason} at byte {exc.start})",
                          "a device or cluster config is UTF-8 YAML; " + _UNITS_HINT) from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML {yaml_problem(exc)}",
                          "check indentation and quoting; " + _UNITS_HINT) from None
    if isinstance(data, Mapping) and "name" not in data:
        # The file's stem is its name; writing it again inside is optional.
        data = {"name": path.stem, **data}
    return data


def _load_device_file(path: Path) -> DeviceSpec:
    if not path.is_file():
        raise ConfigError(f"device file not found: {path}",
                          _available_hint(path.stem, list_devices(), "devices"))
    return device_from_dict(_read_yaml(path), str(path))


def load_device(name_or_path: str | Path) -> DeviceSpec:
    """A device by name (`configs/devices/<name>.yaml`) or from a path to a YAML file."""
    return _load_device_file(_resolve(name_or_path, "devices"))


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A cluster by name (`configs/clusters/<name>.yaml`) or from a path to a YAML file."""
    path = _resolve(name_or_path, "clusters")
    return cluster_from_dict(_read_yaml(path), str(path))


