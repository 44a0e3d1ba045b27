"""Deterministic YAML: fixed key order (the dataclass field order), one style per shape.

Rows (a list of flat mappings, e.g. the search table) and lists of scalars are written on one
line each so a diff of two plans shows one changed row per changed candidate. Floats are already
rounded by the producer (units.round_sig) and written as Python's shortest repr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from planner.errors import PlanError


class _FlowMap(dict):
    pass


class _FlowList(list):
    pass


class _Dumper(yaml.SafeDumper):
    pass


def _repr_flow_map(dumper, data):
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


def _repr_flow_list(dumper, data):
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


def _repr_str(dumper, data):
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(_FlowMap, _repr_flow_map)
_Dumper.add_representer(_FlowList, _repr_flow_list)
_Dumper.add_representer(str, _repr_str)


def _scalar(x) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def _styled(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _styled(v) for k, v in data.items()}
    if isinstance(data, list):
        if all(_scalar(x) for x in data):
            return _FlowList(data)
        return [_FlowMap((k, _FlowList(v) if isinstance(v, list) else v) for k, v in x.items())
                if isinstance(x, dict) and all(_scalar(v) or (isinstance(v, list) and all(map(_scalar, v)))
                                               for v in x.values())
                else _styled(x) for x in data]
    return data


def dump_yaml(data: dict, header: list[str] | None = None) -> str:
    """YAML text for `data` (insertion-ordered), preceded by '# ' comment lines."""
    body = yaml.dump(_styled(data), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=4096, allow_unicode=True)
    lines = [f"# {line}".rstrip() for h in (header or []) for line in h.splitlines()]
    return "\n".join(lines) + ("\n" if lines else "") + body


def read_text_file(path: Path, kind: str) -> str:
    """The file's text; PlanError "<kind> not found" / "cannot read <kind>" otherwise."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise PlanError(f"{kind} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read {kind} {path}: {e}") from None


def read_yaml(path_or_text: str | Path, kind: str) -> tuple[Any, str]:
    """(parsed data, label for messages) from a path, or from YAML text (a str with a newline)."""
    if isinstance(path_or_text, Path) or "\n" not in str(path_or_text):
        path = Path(path_or_text)
        label = f"{kind} {path}"
        text = read_text_file(path, kind)
    else:
        text, label = str(path_or_text), kind
    try:
        return yaml.safe_load(text), label
    except yaml.YAMLError as e:
        raise PlanError(f"{label}: malformed YAML: {' '.join(str(e).split())}") from None
