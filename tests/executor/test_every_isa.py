"""The engine-level kernel tests under every kernel variant this CPU runs besides its default
(HELM_KERNEL_ISA, one subprocess each): the kernel tests themselves loop over the variants, but
the fused decode step, the prompt routes and the probe use the process's one KERNEL_ISA, so
without this an AVX-512 CI machine would never run them on the AVX2 or portable kernels."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.backends import resolve_backend

pytestmark = pytest.mark.skipif(resolve_backend("auto") != "helm", reason="CPU kernels not built")

REPO = Path(__file__).resolve().parents[2]
MODULES = ["tests/executor/test_fused_blocks.py", "tests/executor/test_probe.py"]


def _other_isas() -> list[str]:
    try:
        from executor import kernels
    except ImportError:  # not built: the module is skipped (pytestmark)
        return []
    return [isa for isa in kernels.available_isas() if isa != kernels.KERNEL_ISA]


@pytest.mark.parametrize("isa", _other_isas() or ["(none)"])
def test_engine_level_kernel_tests_pass_on(isa):
    if isa == "(none)":
        pytest.skip("this CPU runs only its default kernel variant")
    env = {**os.environ, "HELM_KERNEL_ISA": isa}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *MODULES],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, f"HELM_KERNEL_ISA={isa}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
