"""Quantities with units in config files: "32GiB", "900GB/s", "15.7TFLOP/s", "5us" -> base units.

Every number partc computes with is in base units (bytes, bytes/s, FLOP/s, seconds); config files
may write units, which `parse_quantity` turns into base units and `format_quantity` writes back.
"""
from __future__ import annotations

import math
import re
from typing import Any

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

