"""Sizes, rates and FLOP rates with their units; float rounding for deterministic files.

One canonical unit each, the one the profile and plan files store: sizes in bytes, bandwidths in
GiB/s (2^30 bytes per second), compute in GFLOP/s (10^9). Input may carry any unit, as datasheets
and Accelerate's max_memory write them: "8GiB", "16 GB", "512MiB", "936 GB/s", "22.4GiB/s",
"82.6 TFLOPS". Binary (GiB) and decimal (GB) prefixes mean what they say, so a datasheet's
936 GB/s is 871.7 GiB/s, not 936. A plain number is already in the canonical unit.
"""
from __future__ import annotations

import math
import re

from planner.errors import PlanError

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10

_SUFFIX_BYTES = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": KIB, "MIB": MIB, "GIB": GIB, "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*(/\s*s)?\s*$")
_FLOPS_SCALE = {"": 1.0, "MFLOPS": 1e-3, "GFLOPS": 1.0, "TFLOPS": 1e3, "PFLOPS": 1e6}


def _in_bits(unit: str) -> bool:
    """A unit of bits: a lowercase b ('Gb', 'Gbps', 'mb'), which upper-casing would read as bytes."""
    unit = unit[:-2] if unit.lower().endswith("ps") else unit
    return unit.endswith("b")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """'8GiB' -> 8589934592; '16GB' -> 16000000000; '1024' -> 1024. Raises PlanError."""
    if isinstance(text, bool):
        raise PlanError(f"{what}: {text!r} is not a size")
    if isinstance(text, int):
        if text >= 2**63:
            raise PlanError(f"{what}: {text!r} is too large")
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if m and _in_bits(m.group(2)):
            raise PlanError(f"{what}: {text!r} is in bits (a lowercase b): give bytes, e.g. 16GB or 8GiB")
        if not m or m.group(2).upper() not in _SUFFIX_BYTES:
            raise PlanError(f"{what}: cannot read {text!r} as a size (use e.g. 8GiB, 16GB, 512MiB)")
        number = float(m.group(1)) * _SUFFIX_BYTES[m.group(2).upper()]
        if not math.isfinite(number) or number >= 2**63:
            raise PlanError(f"{what}: {text!r} is too large")
        value = int(number)
    if value <= 0:
        raise PlanError(f"{what}: {text!r} must be a positive size")
    return value


def _per_second(text, what: str, noun: str, example: str, scale_of) -> float:
    """A rate in the canonical unit: a number as is, text by the scale its unit has (None: unreadable)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _RATE_RE.match(str(text))
        if m and scale_of is _bandwidth_scale and _in_bits(m.group(2)):
            raise PlanError(f"{what}: {text!r} is in bits (a lowercase b): give bytes, e.g. 12.5GB/s for 100Gb/s")
        scale = scale_of(m.group(2).upper(), bool(m.group(3))) if m else None
        if scale is None:
            raise PlanError(f"{what}: cannot read {text!r} as a {noun} (use e.g. {example})")
        value = float(m.group(1)) * scale
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"{what}: {text!r} must be a positive, finite {noun}")
    return value


def _bandwidth_scale(unit: str, per_second: bool) -> float | None:
    if unit.endswith("PS") and not per_second:              # the 'GBps' spelling
        unit, per_second = unit[:-2], True
    if bool(unit) != per_second or (unit and unit not in _SUFFIX_BYTES):
        return None
    return _SUFFIX_BYTES[unit] / GIB if unit else 1.0


def _flops_scale(unit: str, per_second: bool) -> float | None:
    if per_second:                                          # 'GFLOP/s': the /s only after FLOP
        unit = unit + "S" if unit.endswith("FLOP") else "?"
    return _FLOPS_SCALE.get(unit)


def parse_rate(text: str | int | float, what: str = "bandwidth") -> float:
    """A bandwidth in GiB/s: '936 GB/s' -> 871.7; '22.4GiB/s' -> 22.4; 45 -> 45.0. Raises PlanError."""
    return _per_second(text, what, "bandwidth", "936GB/s, 22.4GiB/s, or a number of GiB/s", _bandwidth_scale)


def parse_flops(text: str | int | float, what: str = "compute rate") -> float:
    """A FLOP rate in GFLOP/s: '82.6 TFLOPS' -> 82600; '500 GFLOP/s' -> 500; 500 -> 500.0."""
    return _per_second(text, what, "FLOP rate", "82.6TFLOPS, 500GFLOP/s, or a number of GFLOP/s", _flops_scale)


def fmt_rate(gibps: float) -> str:
    """A bandwidth with both readings, as a reviewer compares it to a datasheet: '871.7 GiB/s (936 GB/s)'."""
    return f"{gibps:.1f} GiB/s ({gibps * GIB / 1e9:.4g} GB/s)"


def fmt_flops(gflops: float) -> str:
    return f"{gflops / 1e3:.4g} TFLOP/s" if gflops >= 1e3 else f"{gflops:.4g} GFLOP/s"


def fmt_bytes(n: int | float) -> str:
    """Human-readable binary size: 8589934592 -> '8.00 GiB'."""
    n = float(n)
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def round_sig(x: float, digits: int = 6) -> float:
    """Round to `digits` significant digits so files carry no float noise (0.1+0.2 -> 0.3)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")
