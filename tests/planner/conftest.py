"""Fixtures for the planner tests: reference configs, machine profiles, cached plans.

Tracing is cached per config inside planner.trace (lru_cache), so every test that plans the same
model in this session pays for the trace once.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from planner.machine import load_machine

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tools" / "model_configs"
MACHINES = REPO / "plans" / "machines"
CONFIG_NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))
LAPTOP = MACHINES / "laptop-rtx4060-i7-13700h.yaml"
DEV = MACHINES / "helm-dev-2core.yaml"
WORKSTATION = MACHINES / "workstation-rtx4090-r9-7950x.yaml"


def config_path(name: str) -> Path:
    return CONFIGS / f"{name}.json"


def rel_source(name: str) -> str:
    """The source string checked-in plans record (relative to the repository root)."""
    return f"tools/model_configs/{name}.json"


@pytest.fixture(scope="session")
def laptop():
    return load_machine(LAPTOP)


@pytest.fixture(scope="session")
def dev_machine():
    return load_machine(DEV)


@pytest.fixture(scope="session")
def laptop_plan_8b(laptop):
    from planner.planning import make_plan
    return make_plan(config_path("qwen3-8b"), laptop, source=rel_source("qwen3-8b"))
