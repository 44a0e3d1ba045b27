"""Byte-size parsing and formatting, and float rounding for deterministic files.

Sizes on the command line follow Accelerate's max_memory spelling: "8GiB", "16GB", "512MiB",
or a plain number of bytes. Binary (GiB) and decimal (GB) suffixes mean what they say.
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
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """'8GiB' -> 8589934592; '16GB' -> 16000000000; '1024' -> 1024. Raises PlanError."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).upper() not in _SUFFIX_BYTES:
            raise PlanError(f"{what}: cannot read {text!r} as a size (use e.g. 8GiB, 16GB, 512MiB)")
        value = int(float(m.group(1)) * _SUFFIX_BYTES[m.group(2).upper()])
    if value <= 0:
        raise PlanError(f"{what}: {text!r} must be a positive size")
    return value


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
