"""Frozen dataclasses <-> plain dicts (for YAML/JSON), driven by the type hints.

One mechanism for every artifact (machine profile, plan): field order is the file's key order,
tuples become lists, Optional fields may be null. Input is schema-validated before it gets here,
so a mismatch is a bug or a schema gap, reported as PlanError with the field path.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from planner.errors import PlanError


#: Field metadata of an optional field added to a format after files of it were written: left out
#: of the file while None, so those files (and their digests) stay as they were.
OMIT_IF_NONE = {"omit_if_none": True}


def to_dict(obj: Any) -> Any:
    """Dataclass -> dict in field order (recursively); tuples -> lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: Any, data: Any, path: str = "") -> Any:
    """Build `cls` (a dataclass or a typing form) from plain data; PlanError names the path."""
    origin = typing.get_origin(cls)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(cls)
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return from_dict(inner[0], data, path)
    if origin is tuple:
        if not isinstance(data, (list, tuple)):
            raise PlanError(f"field '{path}': expected a list, got {type(data).__name__}")
        (item,) = [a for a in typing.get_args(cls) if a is not Ellipsis][:1]
        return tuple(from_dict(item, x, f"{path}[{i}]") for i, x in enumerate(data))
    if dataclasses.is_dataclass(cls):
        if not isinstance(data, dict):
            raise PlanError(f"field '{path or '<top>'}': expected a mapping, got {type(data).__name__}")
        hints = _hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            sub = f"{path}.{f.name}" if path else f.name
            if f.name in data:
                kwargs[f.name] = from_dict(hints[f.name], data[f.name], sub)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"field '{sub}' is missing")
        return cls(**kwargs)
    if cls is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    if cls in (int, float, str, bool) and not isinstance(data, cls):
        raise PlanError(f"field '{path}': expected {cls.__name__}, got {data!r}")
    return data
