"""Hardware descriptions for the analytic cost model: devices, links and clusters.

A device (`configs/devices/<name>.yaml`) says how fast one accelerator computes and streams memory
and how much memory it has; a cluster (`configs/clusters/<name>.yaml`) says how many such devices
there are per node, how many nodes, and how fast the links between them are. Both are frozen
dataclasses of plain numbers in base units (bytes, bytes/s, FLOP/s, seconds) so the cost model and
the solver never deal with units; the YAML files may write quantities with units ("32GiB",
"900GB/s", "15.7TFLOP/s", "5us"), which `parse_quantity` turns into those base units.

Every problem in a config file is a `ConfigError` naming the file and the key, with a hint. The
format is documented in docs/hardware.md.

`calibrate_cpu` measures this machine's CPU so that `configs/devices/cpu.yaml` describes it, which
makes the analytic cost model testable against real timings here (bench/calibrate_cpu.py writes
the file).
"""
from __future__ import annotations

import difflib
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Sequence

import yaml

from partc.errors import PartcError

# Operator classes the cost model prices differently. Every device gives an efficiency for each.
OP_CLASSES = ("matmul", "conv", "attention", "norm", "elementwise", "reduction", "gather", "copy",
              "other")

# Classes that run on matrix units (tensor cores, AMX, oneDNN GEMM kernels): only these reach the
# dtype's matrix peak. Everything else runs on vector units, which are no faster than float32.
MATRIX_CLASSES = ("matmul", "conv", "attention")

# Keys allowed in `peak_flops`. "tf32" is float32 matrix math on tensor cores (used only when the
# device sets allow_tf32); "float8" covers every float8 variant torch has.
DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")

# Common short names, for hints only: the keys themselves are torch's names.
_DTYPE_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
                  "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8"}

BACKENDS = ("nccl", "gloo")
DEVICE_KINDS = ("cuda", "cpu")


class ConfigError(PartcError):
    """A device or cluster config is missing, unreadable, or breaks the schema."""


# --------------------------------------------------------------------------------------------
# Quantities with units

# SI prefixes are powers of 1000, binary ones powers of 1024. Both 'k' and 'K' mean 1000, but 'm'
# is never mega: lower-case 'm' only appears in 'ms'.
_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
# Time units as divisors: 5 / 1e6 is exactly 5e-06, 5 * 1e-6 is not.
_TIME = {"s": 1.0, "ms": 1e3, "us": 1e6, "\u00b5s": 1e6, "\u03bcs": 1e6, "ns": 1e9}
_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S*)\s*$")

# Per unit: the unit suffixes it accepts (each with its factor) and whether binary prefixes apply.
_UNITS: dict[str, tuple[dict[str, float], bool]] = {
    "B": ({"B": 1.0}, True),
    "B/s": ({"B/s": 1.0, "bit/s": 0.125, "b/s": 0.125}, True),
    "FLOP/s": ({"FLOP/s": 1.0, "FLOPS": 1.0, "flop/s": 1.0}, False),
    "s": ({}, False),
    "": ({}, False),
}

UNIT_EXAMPLES = {
    "B": "a size such as 34359738368, '32GiB' or '80GB'",
    "B/s": "a rate such as '900GB/s', '400Gbit/s' or a plain number of bytes/s",
    "FLOP/s": "a rate such as '15.7TFLOP/s' or a plain number of FLOP/s",
    "s": "a time such as '5us', '1.5ms' or a plain number of seconds",
    "": "a plain number",
}


def parse_quantity(value: Any, unit: str) -> float:
    """A config value in base units: bytes ("B"), bytes/s ("B/s"), FLOP/s ("FLOP/s"), seconds ("s")
    or a plain number ("").

    Accepts a YAML int/float, or a string of a number with an optional unit written as
    `<number>[ ]<prefix><unit>`: "32GiB", "80 GB", "900GB/s", "400Gbit/s" (bits: 'b' or 'bit'),
    "15.7TFLOP/s", "5us", "1e9". Prefixes: k/K M G T P E (powers of 1000), Ki Mi Gi Ti Pi (powers
    of 1024, sizes and byte rates only). Raises ValueError with the reason.
    """
    if unit not in _UNITS:
        raise ValueError(f"unknown unit kind {unit!r}")
    if isinstance(value, bool):  # YAML's yes/no/true are not numbers
        raise ValueError(f"expected {UNIT_EXAMPLES[unit]}, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        m = _NUMBER.match(value)
        if not m:
            raise ValueError(f"expected {UNIT_EXAMPLES[unit]}, got {value!r}")
        number = float(m.group(1))
        if unit == "s" and m.group(2) in _TIME:
            number /= _TIME[m.group(2)]
        else:
            number *= _unit_factor(m.group(2), unit, value)
    else:
        raise ValueError(f"expected {UNIT_EXAMPLES[unit]}, got {type(value).__name__} {value!r}")
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _unit_factor(suffix: str, unit: str, original: str) -> float:
    if suffix == "":
        return 1.0
    if unit == "s":
        if suffix in _TIME:
            return 1.0 / _TIME[suffix]
        raise ValueError(f"unknown time unit {suffix!r} in {original!r} (use s, ms, us or ns)")
    names, binary = _UNITS[unit]
    prefixes = {**_SI, **_BINARY} if binary else _SI
    # Longest unit name first so that "b/s" does not shadow "bit/s" and so on.
    for name in sorted(names, key=len, reverse=True):
        if suffix.endswith(name) and suffix[: len(suffix) - len(name)] in prefixes:
            return prefixes[suffix[: len(suffix) - len(name)]] * names[name]
    raise ValueError(f"expected {UNIT_EXAMPLES[unit]}, got {original!r} "
                     f"(unit {suffix!r} is not one of {', '.join(names) or 'none'}"
                     f" with an optional prefix)")


def format_quantity(value: float, unit: str, digits: int = 4) -> str:
    """`value` (base units) written with an SI prefix, e.g. 1.57e13 'FLOP/s' -> '15.7TFLOP/s',
    5e-6 's' -> '5us'. parse_quantity reads it back (to `digits` significant digits)."""
    if unit == "s":
        for name, factor in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
            if abs(value) >= factor or name == "ns":
                return f"{value / factor:.{digits}g}{name}"
    if unit == "":
        return f"{value:.{digits}g}"
    for prefix in ("E", "P", "T", "G", "M", "k", ""):
        if abs(value) >= _SI[prefix] or prefix == "":
            return f"{value / _SI[prefix]:.{digits}g}{prefix}{unit}"
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# Specs

def _dtype_key(dtype: str) -> str:
    """torch dtype names ("torch.float32", "float8_e4m3fn", "half") -> a `peak_flops` key."""
    name = str(dtype).removeprefix("torch.")
    if name.startswith("float8"):
        return "float8"
    return {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)


@dataclass(frozen=True)
class DeviceSpec:
    """One device: compute peaks, memory bandwidth and capacity, and how much of it is reached.

    Time of an operator in the analytic model is `op_overhead_s + max(flops / flops_per_s(dtype,
    class), bytes / bytes_per_s())`. Numbers are in base units (bytes, bytes/s, FLOP/s, seconds).
    """

    name: str
    kind: str  # "cuda" | "cpu"
    memory_bytes: int  # usable memory per device
    peak_flops: dict[str, float]  # dtype -> dense peak FLOP/s; "float32" always present
    memory_bandwidth: float  # bytes/s, peak
    efficiency: dict[str, float]  # op class (every one of OP_CLASSES) -> fraction of peak reached
    bandwidth_efficiency: float  # fraction of memory_bandwidth reached by streaming ops
    op_overhead_s: float  # fixed time per executed (non-view) operator: launch / dispatch
    description: str = ""
    source: str = ""
    allow_tf32: bool = False  # float32 matrix ops run at the "tf32" peak (when it is given)

    def __post_init__(self) -> None:
        problems = _device_problems(self)
        if problems:
            raise ValueError(f"invalid DeviceSpec {self.name!r}: {problems[0]}")

    def flops_per_s(self, dtype: str, op_class: str) -> float:
        """FLOP/s an operator of `op_class` reaches on `dtype` operands.

        Matrix classes (matmul, conv, attention) get the dtype's peak (float32 with allow_tf32: the
        tf32 peak); a dtype the device does not list falls back to float32. Other classes run on
        vector units, which tensor cores do not speed up, so they get at most the float32 peak.
        Torch dtype names are accepted ("float8_e4m3fn" -> float8; integer dtypes -> float32).
        """
        if op_class not in self.efficiency:
            raise ValueError(f"unknown op class {op_class!r}; expected one of {OP_CLASSES}")
        key = _dtype_key(dtype)
        fp32 = self.peak_flops["float32"]
        if op_class in MATRIX_CLASSES:
            if key == "float32" and self.allow_tf32 and "tf32" in self.peak_flops:
                key = "tf32"
            peak = self.peak_flops.get(key, fp32)
        else:
            peak = min(self.peak_flops.get(key, fp32), fp32)
        return peak * self.efficiency[op_class]

    def bytes_per_s(self) -> float:
        """Memory bandwidth that streaming operators reach (bytes/s)."""
        return self.memory_bandwidth * self.bandwidth_efficiency

    def to_dict(self) -> dict[str, Any]:
        """Plain data in base units; `device_from_dict` reads it back to an equal spec."""
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "source": self.source,
            "memory_bytes": self.memory_bytes,
            "peak_flops": {k: self.peak_flops[k] for k in sorted(self.peak_flops)},
            "allow_tf32": self.allow_tf32,
            "memory_bandwidth": self.memory_bandwidth,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "efficiency": {k: self.efficiency[k] for k in OP_CLASSES},
            "op_overhead_s": self.op_overhead_s,
        }


def _device_problems(d: DeviceSpec) -> list[str]:
    problems = []
    if d.kind not in DEVICE_KINDS:
        problems.append(f"kind {d.kind!r} is not one of {DEVICE_KINDS}")
    if "float32" not in d.peak_flops:
        problems.append("peak_flops has no 'float32'")
    problems += [f"unknown dtype {k!r} in peak_flops" for k in d.peak_flops if k not in DTYPES]
    problems += [f"peak_flops[{k!r}] must be > 0" for k, v in d.peak_flops.items() if not v > 0]
    if set(d.efficiency) != set(OP_CLASSES):
        problems.append(f"efficiency must give exactly the op classes {OP_CLASSES}")
    problems += [f"efficiency[{k!r}] must be in (0, 1]" for k, v in d.efficiency.items()
                 if not 0 < v <= 1]
    if not 0 < d.bandwidth_efficiency <= 1:
        problems.append("bandwidth_efficiency must be in (0, 1]")
    if not d.memory_bytes > 0:
        problems.append("memory_bytes must be > 0")
    if not d.memory_bandwidth > 0:
        problems.append("memory_bandwidth must be > 0")
    if not d.op_overhead_s >= 0:
        problems.append("op_overhead_s must be >= 0")
    return problems


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point link: bandwidth per direction (bytes/s) and per-message latency (s)."""

    bandwidth: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency_s >= 0:
            raise ValueError(f"invalid LinkSpec: bandwidth must be > 0 and latency_s >= 0, "
                             f"got {self.bandwidth}, {self.latency_s}")

    def transfer_s(self, nbytes: int) -> float:
        """Time to send `nbytes` over this link: latency + nbytes / bandwidth (0 for no bytes)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return 0.0 if nbytes == 0 else self.latency_s + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth": self.bandwidth, "latency_s": self.latency_s}


@dataclass(frozen=True)
class ClusterSpec:
    """`num_nodes` nodes of `devices_per_node` identical devices. Device i lives on node
    i // devices_per_node; devices of one node talk over `intra_node`, others over `inter_node`
    (bandwidth per device: a node's NICs shared by its devices)."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    num_nodes: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    backend: str  # "nccl" | "gloo"
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.num_nodes < 1:
            raise ValueError("devices_per_node and num_nodes must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {BACKENDS}")

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    def node_of(self, device_index: int) -> int:
        """The node that device `device_index` (0 .. num_devices-1) belongs to."""
        if not 0 <= device_index < self.num_devices:
            raise ValueError(f"device index {device_index} out of range 0..{self.num_devices - 1}")
        return device_index // self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link between devices a and b: intra-node when they share a node, else inter-node."""
        return self.intra_node if self.node_of(a) == self.node_of(b) else self.inter_node

    def allreduce_s(self, nbytes: int, group: Sequence[int]) -> float:
        """Ring all-reduce of `nbytes` over the devices in `group`.

        2(n-1)/n * nbytes / B + 2(n-1) * L, where B and L are the bandwidth and latency of the
        slowest link the ring uses (inter-node as soon as the group spans nodes). 0 when the group
        has at most one device or there is nothing to reduce.
        """
        n = len(group)
        if len(set(group)) != n:
            raise ValueError(f"group has repeated devices: {list(group)}")
        nodes = [self.node_of(i) for i in group]
        if n <= 1 or nbytes == 0:
            return 0.0
        links = []
        if len(set(nodes)) < n:  # some two devices share a node: the ring uses an intra link
            links.append(self.intra_node)
        if len(set(nodes)) > 1:
            links.append(self.inter_node)
        slowest = min(links, key=lambda link: link.bandwidth)
        return 2 * (n - 1) / n * nbytes / slowest.bandwidth + 2 * (n - 1) * slowest.latency_s

    def to_dict(self) -> dict[str, Any]:
        """Plain data in base units, the device inline; `cluster_from_dict` reads it back."""
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "device": self.device.to_dict(),
            "devices_per_node": self.devices_per_node,
            "num_nodes": self.num_nodes,
            "backend": self.backend,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
        }


# --------------------------------------------------------------------------------------------
# Reading configs

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
    return number


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
    name = m.string("name")
    kind = m.string("kind", choices=DEVICE_KINDS)
    memory = m.quantity("memory_bytes", "B")
    peaks_in = m.sub("peak_flops")
    assert peaks_in is not None
    peaks: dict[str, float] = {}
    for dtype in peaks_in.data:
        if dtype not in DTYPES:
            alias = _DTYPE_ALIASES.get(str(dtype).lower())
            _fail(where, peaks_in.key(str(dtype)), "unknown dtype",
                  hint=(f"did you mean '{alias}'?" if alias else _suggest(str(dtype), DTYPES))
                  or f"dtypes: {', '.join(DTYPES)}")
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
    spec = DeviceSpec(
        name=name,
        kind=kind,
        memory_bytes=int(round(memory)),
        peak_flops={k: peaks[k] for k in sorted(peaks)},
        memory_bandwidth=m.quantity("memory_bandwidth", "B/s"),
        efficiency=efficiency,
        bandwidth_efficiency=m.quantity("bandwidth_efficiency", "", at_most=1.0),
        op_overhead_s=m.quantity("op_overhead_s", "s", positive=False),
        description=m.string("description", required=False),
        source=m.string("source", required=False),
        allow_tf32=m.boolean("allow_tf32", False),
    )
    m.finish()
    return spec


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
    name = m.string("name")
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
    """The configs/ folder: $PARTC_CONFIG_DIR if set, else the repository's configs/."""
    env = os.environ.get("PARTC_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "configs"


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
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}",
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


LOCAL_CLUSTER = "local"


def local_cluster() -> ClusterSpec:
    """This machine as a cluster (what `--cluster local`, the default, means).

    With CUDA GPUs: one device per GPU, the device config whose name matches the GPU's (e.g. an
    "NVIDIA H100 80GB HBM3" is h100-80gb) with the GPU's real memory, NCCL, and the intra-node
    link of a shipped cluster config of that device. Without: the CPU as one gloo process per
    physical core, priced with the calibrated cpu device (configs/devices/cpu.yaml), each device
    getting an equal share of the RAM, and the loopback link measured in configs/clusters/cpu.yaml.
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return _local_gpus(torch.cuda.device_count(), torch.cuda.get_device_properties(0))
    cores = physical_cores()
    base = load_cluster("cpu")
    device = replace(base.device, memory_bytes=ram_bytes() // cores,
                     description=f"{cpu_model()}: 1 of {cores} physical core(s), "
                                 f"{ram_bytes() / 2**30:.1f} GiB RAM shared equally")
    return replace(base, name=LOCAL_CLUSTER, device=device, devices_per_node=cores, num_nodes=1,
                   description=f"this machine: {cores} gloo process(es), one per physical core",
                   source="detected: /proc/cpuinfo, /proc/meminfo; costs of configs/devices/cpu.yaml")


def _local_gpus(count: int, props: Any) -> ClusterSpec:
    gpu = str(props.name)
    memory = int(props.total_memory)
    best: DeviceSpec | None = None
    for name in list_devices():
        spec = load_device(name)
        family = name.split("-")[0].upper()  # a100-80gb -> A100
        if spec.kind == "cuda" and family in gpu.upper().replace(" ", "") and \
                (best is None or abs(spec.memory_bytes - memory) < abs(best.memory_bytes - memory)):
            best = spec
    if best is None:
        raise ConfigError(f"no device config matches this machine's GPU ({gpu})",
                          hint=f"pass --cluster with a cluster config (configs/clusters/), or add "
                               f"a device to {config_dir() / 'devices'}")
    link = next((c.intra_node for c in (load_cluster(n) for n in list_clusters())
                 if c.device.name == best.name), None)
    if link is None:
        raise ConfigError(f"no cluster config describes the links between {best.name} devices",
                          hint="pass --cluster with a cluster config")
    device = replace(best, memory_bytes=memory, description=f"{gpu} (config {best.name})")
    return ClusterSpec(name=LOCAL_CLUSTER, device=device, devices_per_node=count, num_nodes=1,
                       intra_node=link, inter_node=link, backend="nccl",
                       description=f"this machine: {count} x {gpu}",
                       source=f"detected by torch.cuda; costs of configs/devices/{best.name}.yaml")


def resolve_cluster(name_or_path: str | Path) -> ClusterSpec:
    """`local` (this machine, see local_cluster) or a cluster config name or path."""
    if str(name_or_path) == LOCAL_CLUSTER:
        return local_cluster()
    return load_cluster(name_or_path)


# --------------------------------------------------------------------------------------------
# CPU calibration

@dataclass(frozen=True)
class CpuCalibration:
    """What `measure_cpu` found: the DeviceSpec and the raw measurements behind each number."""

    spec: DeviceSpec
    cpu_model: str
    physical_cores: int
    ram_bytes: int
    threads: int
    measurements: dict[str, float] = field(default_factory=dict)  # name -> value, base units


def cpu_model() -> str:
    """This machine's CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads of one core count once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores: set[tuple[str, str]] = set()
    try:
        block: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            if ":" in line:
                k, v = line.split(":", 1)
                block[k.strip()] = v.strip()
            elif block:
                cpu = int(block.get("processor", "-1"))
                if allowed is None or cpu in allowed:
                    cores.add((block.get("physical id", "0"), block.get("core id", str(cpu))))
                block = {}
    except (OSError, ValueError):
        pass
    return len(cores) or len(allowed or ()) or os.cpu_count() or 1


def ram_bytes() -> int:
    """Physical RAM (MemTotal of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("MemTotal not found in /proc/meminfo")


def _median_time(fn: Callable[[], Any], budget_s: float, min_reps: int = 3,
                 max_reps: int = 200) -> float:
    """Median wall time of fn() after one warm-up call, repeated until the budget is spent."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps
                                     or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _counted_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of fn() as partc's OpGraph counts them (torch's flop counter + partc's formulas)."""
    from partc.flop_count import flop_counter_mode
    with flop_counter_mode() as counter:
        fn()
    return int(counter.get_total_flops())


def measure_cpu(threads: int = 1, seconds: float = 20.0) -> CpuCalibration:
    """Measure this machine's CPU as a partc device of `threads` cores (see calibrate_cpu)."""
    import torch
    import torch.nn.functional as F

    if threads < 1 or seconds <= 0:
        raise ValueError("threads must be >= 1 and seconds > 0")
    quick = seconds < 5  # smoke runs: small sizes so that every step stays in budget
    unit = seconds / 20.0  # the full run's budget shares below add up to about 20 units
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    found: dict[str, float] = {}
    try:
        # -- matmul: the measured peak is the best shape; efficiency is the median over
        # squares and transformer-like linear shapes (forward and weight gradient).
        def mm_rate(m: int, k: int, n: int, dtype: torch.dtype, budget: float) -> float:
            a = torch.randn(m, k, dtype=dtype)
            b = torch.randn(k, n, dtype=dtype)
            return 2.0 * m * k * n / _median_time(lambda: torch.mm(a, b), budget)

        sizes = [(256, 256, 256), (512, 512, 512), (512, 256, 1024)] if quick else [
            (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
            (2048, 768, 3072), (768, 2048, 3072)]
        rates = [mm_rate(m, k, n, torch.float32, 1.0 * unit) for m, k, n in sizes]
        for (m, k, n), r in zip(sizes, rates):
            found[f"matmul_float32_{m}x{k}x{n}_flop_s"] = r
        peak32 = max(rates)  # raised below if conv or attention beat it
        peaks: dict[str, float] = {}

        # Other dtypes: a small probe first. A dtype slower than 1/20 of float32 (no native
        # kernels, e.g. float16 without AVX512-FP16) keeps the probe's rate rather than being
        # timed at large sizes for long; leaving it out would price it at the float32 peak.
        probe = 256 if quick else 512
        big = 512 if quick else 2048
        for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                            ("float64", torch.float64)):
            first = mm_rate(probe, probe, probe, dtype, 0.3 * unit)
            found[f"matmul_{name}_{probe}_flop_s"] = first
            peaks[name] = first
            if first >= peak32 / 20:
                second = mm_rate(big, big, big, dtype, 1.0 * unit)
                found[f"matmul_{name}_{big}_flop_s"] = second
                peaks[name] = max(first, second)

        # -- conv and attention, forward + backward as in training, FLOPs counted the way the
        # OpGraph counts them.
        n, c, hw = (2, 32, 16) if quick else (8, 64, 56)
        x = torch.randn(n, c, hw, hw, requires_grad=True)
        w = torch.randn(c, c, 3, 3, requires_grad=True)

        def conv_step() -> None:
            y = F.conv2d(x, w, padding=1)
            torch.autograd.grad(y, (x, w), torch.ones_like(y))

        conv_rate = _counted_flops(conv_step) / _median_time(conv_step, 2.0 * unit)
        found["conv2d_fwd_bwd_flop_s"] = conv_rate

        b, h, seq, d = (1, 4, 128, 64) if quick else (2, 8, 512, 64)
        q, k_, v = (torch.randn(b, h, seq, d, requires_grad=True) for _ in range(3))

        def attention_step() -> None:
            o = F.scaled_dot_product_attention(q, k_, v)
            torch.autograd.grad(o, (q, k_, v), torch.ones_like(o))

        attn_rate = _counted_flops(attention_step) / _median_time(attention_step, 2.0 * unit)
        found["sdpa_fwd_bwd_flop_s"] = attn_rate
        peak32 = max(peak32, conv_rate, attn_rate)
        peaks["float32"] = peak32
        matmul_eff = statistics.median(rates) / peak32

        # -- per-operator overhead: eager dispatch of an op whose work is nothing.
        one = torch.ones(1)
        loops = 200 if quick else 2000

        def tiny_ops() -> None:
            for _ in range(loops):
                torch.add(one, one)

        overhead = _median_time(tiny_ops, 0.5 * unit) / loops
        found["op_overhead_s"] = overhead

        # -- memory bandwidth: streams over tensors far larger than the caches, counting bytes
        # read + written. The fastest is the peak; one typical operator per bandwidth-bound class
        # sets bandwidth_efficiency (the median of their fractions of the peak). Outputs are
        # preallocated (out=): a fresh tensor over glibc's mmap threshold (32 MiB) is page-faulted
        # in on every call, which would measure the allocator rather than the operator.
        numel = (4 << 20) if quick else (32 << 20)  # 16 MiB / 128 MiB of float32 per tensor
        src = torch.randn(numel)
        dst = torch.empty(numel)
        other = torch.randn(numel)
        nbytes = numel * 4

        def stream(fn: Callable[[], Any], moved: int, budget: float) -> float:
            return moved / max(_median_time(fn, budget) - overhead, 1e-9)

        copy_bw = stream(lambda: dst.copy_(src), 2 * nbytes, 1.0 * unit)
        add_bw = stream(lambda: torch.add(src, other, out=dst), 3 * nbytes, 1.0 * unit)
        found["stream_copy_B_s"] = copy_bw
        found["stream_add_B_s"] = add_bw
        peak_bw = max(copy_bw, add_bw)

        hidden = 1024
        rows = numel // hidden
        x2, y2 = src.view(rows, hidden), dst.view(rows, hidden)
        ln_w, ln_b = torch.ones(hidden), torch.zeros(hidden)
        ln_stats = torch.empty(rows, 1), torch.empty(rows, 1)
        row_sums = torch.empty(rows)
        index = torch.randint(0, rows, (rows,))
        square, transposed = src.view(-1, 4096), dst.view(4096, -1)
        aten = torch.ops.aten
        class_bw = {
            "elementwise": stream(lambda: torch.mul(src, other, out=dst), 3 * nbytes, 0.6 * unit),
            "norm": stream(lambda: aten.native_layer_norm.out(
                x2, [hidden], ln_w, ln_b, 1e-5, out0=y2, out1=ln_stats[0], out2=ln_stats[1]),
                2 * nbytes, 0.6 * unit),
            "reduction": stream(lambda: torch.sum(x2, dim=1, out=row_sums), nbytes + rows * 4,
                                0.6 * unit),
            "gather": stream(lambda: torch.index_select(x2, 0, index, out=y2),
                             2 * nbytes + rows * 8, 0.6 * unit),
            "copy": stream(lambda: transposed.copy_(square.t()), 2 * nbytes, 0.6 * unit),
        }
        for name, bw in class_bw.items():
            found[f"{name}_B_s"] = bw
        bandwidth_eff = min(1.0, statistics.median(bw / peak_bw for bw in class_bw.values()))
    finally:
        torch.set_num_threads(previous_threads)

    cores = physical_cores()
    ram = ram_bytes()
    devices = max(1, cores // threads)
    model = cpu_model()
    # Bandwidth-bound classes count no FLOPs in the OpGraph (torch's flop counter prices only
    # matrix ops), so their FLOP efficiency cannot be measured; 0.5 is the documented default.
    efficiency = {
        "matmul": round(min(1.0, matmul_eff), 3),
        "conv": round(min(1.0, conv_rate / peak32), 3),
        "attention": round(min(1.0, attn_rate / peak32), 3),
        "norm": 0.5, "elementwise": 0.5, "reduction": 0.5, "gather": 0.5, "copy": 0.5,
        "other": 0.3,
    }
    spec = DeviceSpec(
        name="cpu",
        kind="cpu",
        memory_bytes=ram // devices,
        peak_flops={k: float(f"{peaks[k]:.4g}") for k in sorted(peaks)},
        memory_bandwidth=float(f"{peak_bw:.4g}"),
        efficiency=efficiency,
        bandwidth_efficiency=round(bandwidth_eff, 3),
        op_overhead_s=float(f"{overhead:.3g}"),
        description=(f"This machine's CPU ({model}, {cores} physical cores, "
                     f"{ram / 2**30:.1f} GiB RAM) as {devices} device(s) of {threads} core(s) "
                     f"each, eager PyTorch with {threads} thread(s) per device"),
        source=f"calibrated by bench/calibrate_cpu.py on {model}",
    )
    return CpuCalibration(spec=spec, cpu_model=model, physical_cores=cores, ram_bytes=ram,
                          threads=threads, measurements=found)


def calibrate_cpu(threads: int = 1, seconds: float = 20.0) -> DeviceSpec:
    """A DeviceSpec of this machine's CPU, measured: one device = `threads` cores.

    Peak FLOP/s per dtype is the best dense matrix operator measured (float32, bfloat16, float16,
    float64; a dtype 20x slower than float32 is only probed at one small size). Matmul, conv and
    attention efficiencies are their achieved fractions of the float32 peak (conv and attention
    forward + backward). Memory bandwidth is the best large-tensor stream (bytes read + written
    per second), bandwidth_efficiency the median fraction of it that norm, elementwise,
    reduction, gather and copy operators reach. The per-operator overhead is the eager time of a
    1-element add; memory is RAM * threads / cores.
    Takes about `seconds` (plus warm-up); `seconds` < 5 uses small sizes (a smoke test).
    """
    return measure_cpu(threads, seconds).spec
