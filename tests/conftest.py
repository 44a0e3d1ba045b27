"""Fixtures shared by the whole test suite.

`checkpoint` builds tiny random-weight Hugging Face checkpoints (tools/make_model.py) once per session,
so every test that compares HELM against transformers reads the same files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tools.make_model import make_model

if not torch.cuda.is_available():
    # Triton kernels (executor/paged_decode.py) run on the CPU under Triton's interpreter, which
    # must be on before triton is first imported: its standard library is made for one or the other
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    from executor.device_step import ready_profiler_for_graphs

    ready_profiler_for_graphs()  # the CUDA tests profile graph replays


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """Factory: `checkpoint(arch, dtype="fp32", seed=0, **overrides) -> Path`.

    Builds `tools.make_model.make_model(arch, "tiny", dtype, seed, overrides=overrides)` into a
    session temp dir, once per distinct arguments (cached). arch: qwen3, llama, qwen2, mistral;
    dtype: bf16, fp16, fp32; overrides patch config.json fields, e.g. num_hidden_layers=2 or
    rope_scaling={...}. The directory is shared by every caller: treat it as read-only.
    """
    cache: dict[str, Path] = {}

    def build(arch: str, dtype: str = "fp32", seed: int = 0, **overrides) -> Path:
        key = json.dumps([arch, dtype, seed, overrides], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}-{dtype}-seed{seed}")
            cache[key] = make_model(arch, "tiny", dtype, seed, out, overrides=overrides or None)
        return cache[key]

    return build


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run the suite's tiny models on one thread: their ops are far too small to gain from a
    second one, and OpenMP spin-waiting on a busy 2-core machine made them ~10x slower. Kernel
    tests that exercise several threads pass num_threads explicitly. Reset before every test:
    loading a plan sets torch's threads to the plan's CPU threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
