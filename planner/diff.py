"""`helm-plan diff A B`: what differs between two plans, by meaning, not by text.

Plans are compared as data (so key order and number formatting never show up). Lists with an
identity are matched by it — stages and per-stage predictions by device, search rows by k, IR
units by index, a profile's kernel rates by dtype and rows — so a plan for another machine reads
as "split 21 → 38, cpu stage +17 units, DRAM 45 → 5.2 GiB/s", not as shifted lines. The digest
is derived, so it is not compared.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan

_MISSING = object()
SECTIONS = ("partition", "kv", "prediction", "longest_context", "machine", "calibration", "recalibration", "workload", "limits", "model",
            "plan_version", "parent_digest", "tool_version", "schema_version", "kind", "search", "ir")
_KEYED = {"partition.stages": "device", "prediction.stages": "device", "search.candidates": "split_k",
          "ir.units": "index", "ir.shared_weights": "name", "recalibration.devices": "device",
          "machine.datasheet.rates": "field", "machine.cpu.kernels.dtypes": "dtype"}
_KEYED_LEAVES = {"prompt_gflops": "rows"}  # lists keyed wherever they are (under a keyed row's path)
_SUMMARIZED = ("search.candidates", "ir.units", "recalibration.residuals")  # many rows: counted in the text output


@dataclass(frozen=True)
class Change:
    section: str
    path: str
    a: Any          # None with a_present False when absent
    b: Any
    a_present: bool = True
    b_present: bool = True


def _walk(a, b, path: str, out: list[Change]) -> None:
    if path.startswith("recalibration") and (a is _MISSING) != (b is _MISSING):
        # a plan gained (or lost) its calibration's provenance: show it leaf by leaf, not as one blob
        other = b if a is _MISSING else a
        if isinstance(other, (dict, list)):
            empty = type(other)()
            a, b = (empty if a is _MISSING else a), (empty if b is _MISSING else b)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if path == "" and k == "digest":
                continue
            _walk(a.get(k, _MISSING), b.get(k, _MISSING), f"{path}.{k}" if path else k, out)
        return
    key = _KEYED.get(path) or _KEYED_LEAVES.get(path.rsplit(".", 1)[-1])
    if key and isinstance(a, list) and isinstance(b, list):
        am = {x.get(key): x for x in a if isinstance(x, dict)}
        bm = {x.get(key): x for x in b if isinstance(x, dict)}
        for k in list(am) + [k for k in bm if k not in am]:
            _walk(am.get(k, _MISSING), bm.get(k, _MISSING), f"{path}[{k}]", out)
        return
    if isinstance(a, list) and isinstance(b, list) and any(isinstance(x, dict) for x in a + b):
        for i in range(max(len(a), len(b))):
            _walk(a[i] if i < len(a) else _MISSING, b[i] if i < len(b) else _MISSING, f"{path}[{i}]", out)
        return
    if a is _MISSING or b is _MISSING or a != b or isinstance(a, bool) != isinstance(b, bool):
        section = path.split(".")[0].split("[")[0]
        out.append(Change(section, path, None if a is _MISSING else a, None if b is _MISSING else b,
                          a is not _MISSING, b is not _MISSING))


def diff_plans(a: Plan, b: Plan) -> list[Change]:
    """Every leaf that differs, grouped by section in SECTIONS order."""
    changes: list[Change] = []
    _walk(a.to_dict(), b.to_dict(), "", changes)
    order = {s: i for i, s in enumerate(SECTIONS)}
    return sorted(changes, key=lambda c: order.get(c.section, len(order)))


def _fmt(x: Any, present: bool = True) -> str:
    if not present:
        return "(absent)"
    if isinstance(x, (dict, list)):
        return json.dumps(x, separators=(", ", ": "))
    if x is None:
        return "null"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, float):
        return f"{x:g}"
    return str(x)


def _rel(a: Any, b: Any) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool) and a:
        return f" ({(b - a) / abs(a) * 100:+.1f}%)"
    return ""


def format_diff(a: Plan, b: Plan, changes: list[Change], label_a: str = "A", label_b: str = "B") -> str:
    if not changes:
        return f"plans are equivalent: {label_a} and {label_b}\n"
    lines = [f"--- {label_a}  ({a.model.architecture} on {a.machine.name} [{a.machine.source}], {a.digest[:19]}…)",
             f"+++ {label_b}  ({b.model.architecture} on {b.machine.name} [{b.machine.source}], {b.digest[:19]}…)"]
    by_section: dict[str, list[str]] = {}   # changes in SECTIONS order, each section printed once
    summarized: dict[str, list[str]] = {}
    for c in changes:
        prefix = next((p for p in _SUMMARIZED if c.path.startswith(p + "[")), None)
        if prefix:
            row = c.path[len(prefix) + 1:].split("]")[0]
            rows = summarized.setdefault(prefix, [])
            if row not in rows:
                rows.append(row)
            by_section.setdefault(c.section, [])
            continue
        by_section.setdefault(c.section, []).append(
            f"  {c.path}: {_fmt(c.a, c.a_present)} -> {_fmt(c.b, c.b_present)}{_rel(c.a, c.b)}")
    for prefix, rows in summarized.items():
        section, key = prefix.split(".")
        total = max(len(p.to_dict().get(section, {}).get(key, [])) for p in (a, b))
        what = {"search.candidates": "k", "ir.units": "unit"}.get(prefix, "row")
        by_section[section].append(f"  {prefix}: {len(rows)} of {total} rows differ ({what} = {', '.join(rows[:12])}"
                                   f"{', …' if len(rows) > 12 else ''}); see --json for every value")
    for section, section_lines in by_section.items():
        lines.append(f"{section}:")
        lines.extend(section_lines)
    return "\n".join(lines) + "\n"


def diff_json(a: Plan, b: Plan, changes: list[Change]) -> dict:
    return {
        "equal": not changes,
        "a": {"digest": a.digest, "machine": a.machine.name, "machine_source": a.machine.source,
              "split_k": a.partition.split_k},
        "b": {"digest": b.digest, "machine": b.machine.name, "machine_source": b.machine.source,
              "split_k": b.partition.split_k},
        "sections": sorted({c.section for c in changes}, key=lambda s: SECTIONS.index(s) if s in SECTIONS else 99),
        "changes": [{"section": c.section, "path": c.path,
                     "a": c.a if c.a_present else None, "b": c.b if c.b_present else None,
                     "a_present": c.a_present, "b_present": c.b_present} for c in changes],
    }
