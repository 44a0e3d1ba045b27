"""Deterministic YAML: fixed key order (the dataclass field order), one style per shape.

Rows (a list of flat mappings, e.g. the search table) and lists of scalars are written on one
line each so a diff of two plans shows one changed row per changed candidate. Floats are already
rounded by the producer (units.round_sig) and written as Python's shortest repr.

Reading is hardened because the daemon reads plans sent over the network: files are size-checked
before they are read (and must be regular files: a FIFO would block), YAML anchors and aliases
are refused (a few KB of nested aliases expand to gigabytes), and error messages give a line and
column, never the text around them.
"""
from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from planner.errors import PlanError


class _FlowMap(dict):
    pass


class _FlowList(list):
    pass


MAX_FILE_BYTES = 1 << 20  # the largest plan in plans/ is under 40 KB
MAX_YAML_NODES = 20_000  # the largest checked-in plan has ~3,200; composing is pure Python


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True  # readers refuse aliases, so the writer never emits one


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


def check_writable(path: str | Path, what: str, make_parents: bool = False) -> None:
    """PlanError now, before long work, if `path` will not be writable: a directory, no directory
    to put it in (with `make_parents`: none that the writer could make), or one this user cannot
    write. Creates nothing."""
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"cannot write {what} {path}: it is a directory")
    if path.exists():  # written in place (a file, /dev/stdout): the file's own permission decides
        if not os.access(path, os.W_OK):
            raise PlanError(f"cannot write {what} {path}: permission denied")
        return
    parent = path.parent
    while make_parents and not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PlanError(f"cannot write {what} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlanError(f"cannot write {what} {path}: permission denied")


def read_text_file(path: Path, kind: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file's UTF-8 text; PlanError "<kind> not found" / "cannot read <kind>" otherwise.
    Only a regular file of at most `max_bytes` is read; messages never quote its content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not block
    except FileNotFoundError:
        raise PlanError(f"{kind} not found: {path}") from None
    except OSError as e:
        raise PlanError(f"cannot read {kind} {path}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PlanError(f"cannot read {kind} {path}: not a regular file")
        if info.st_size > max_bytes:
            raise PlanError(f"cannot read {kind} {path}: {info.st_size} bytes, more than the limit of {max_bytes}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise PlanError(f"cannot read {kind} {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew after fstat
        raise PlanError(f"cannot read {kind} {path}: more than the limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"cannot read {kind} {path}: not UTF-8 text (byte {e.start})") from None


class _SafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader without anchors and aliases (HELM files never need them)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(None, None, "anchors and aliases (&name, *name) are not allowed",
                                              event.start_mark)
        self._nodes = getattr(self, "_nodes", 0) + 1
        if self._nodes > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_NODES} values", event.start_mark)
        return super().compose_node(parent, index)


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def parse_yaml(text: str, label: str, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """Parsed YAML; PlanError naming the line and column (never quoting the text) when it is not."""
    if len(text) > max_bytes:  # characters: a cheap first bound before encoding
        raise PlanError(f"{label}: more than the limit of {max_bytes} bytes")
    if len(text.encode("utf-8")) > max_bytes:
        raise PlanError(f"{label}: more than the limit of {max_bytes} bytes")
    try:
        data = yaml.load(text, Loader=_SafeLoader)  # noqa: S506 — a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = _QUOTED.sub("'…'", e.problem or "")  # PyYAML quotes the offending text
        problem = problem.split("'", 1)[0] if problem.count("'") % 2 else problem  # a quote left open
        problem = problem.split('"', 1)[0][:200]
        raise PlanError(f"{label}: malformed YAML{where}: {problem}") from None
    except yaml.YAMLError:
        raise PlanError(f"{label}: malformed YAML") from None
    except RecursionError:
        raise PlanError(f"{label}: malformed YAML: nested too deeply") from None
    except ValueError:  # e.g. an integer with more digits than Python converts
        raise PlanError(f"{label}: malformed YAML: a value cannot be converted") from None
    where = _non_finite(data)
    if where is not None:
        raise PlanError(f"{label}: field '{where}': must be a finite number, not .nan or .inf")
    return data


def _non_finite(data: Any, path: str = "") -> str | None:
    """The dotted path of the first NaN or infinity in parsed YAML; None if there is none."""
    if isinstance(data, float):
        return None if math.isfinite(data) else (path or "(top)")
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list):
        items = ((f"[{i}]", v) for i, v in enumerate(data))
    else:
        return None
    for key, value in items:
        key = str(key)
        where = _non_finite(value, key if not path else (path + key if key.startswith("[") else f"{path}.{key}"))
        if where is not None:
            return where
    return None


def read_yaml(path_or_text: str | Path, kind: str) -> tuple[Any, str]:
    """(parsed data, label for messages) from a path, or from YAML text (a str with a newline)."""
    if isinstance(path_or_text, Path) or "\n" not in str(path_or_text):
        path = Path(path_or_text)
        label = f"{kind} {path}"
        text = read_text_file(path, kind)
    else:
        text, label = str(path_or_text), kind
    return parse_yaml(text, label), label
