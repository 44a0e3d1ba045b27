"""HELM planner: config → IR → costs → machine profile → search → plan."""
from __future__ import annotations

try:
    from importlib.metadata import version as _version

    __version__ = _version("helm")
except Exception:  # noqa: BLE001 — not installed (running from a checkout)
    __version__ = "0.1.0"
