"""executor/device_probe.py: the GPU stage's figures the profile records, measured through the
executor's own code. Here its code runs on CPU tensors (no CUDA graphs); what is checked is
what it times and how the figure follows from the timings."""
from __future__ import annotations

import pytest
import torch

from executor import device_probe
from executor.device_step import ResidentDecode

TINY_BLOCK = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
              "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 1, "vocab_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "rope_theta": 1e6, "torch_dtype": "bfloat16"}


def test_a_decode_block_is_timed_through_the_stages_static_step_at_two_depths(monkeypatch):
    """Each timed call is one decode step of the stage (the static step, as the engine runs a GPU
    stage), of the shallow stage first and then the deep one; the figure is the difference of
    their best times over the difference of depths."""
    steps = []
    call = ResidentDecode.__call__

    def recorded(self, x, batch):
        out = call(self, x, batch)
        steps.append((len(self.blocks), batch.slices[0].start, tuple(out.shape), bool(torch.isfinite(out).all())))
        return out

    monkeypatch.setattr(ResidentDecode, "__call__", recorded)
    times = iter([3e-3, 2e-3, 2.5e-3,     # the 2-block stage: best 2 ms
                  9e-3, 8e-3, 8.5e-3])    # the 6-block stage: best 8 ms
    timed = []

    def timer(fn, reps):
        before = len(steps)
        for _ in range(reps):
            fn()
        timed.append((steps[before][0], len(steps) - before))
        return next(times)

    ms = device_probe.decode_block_ms("cpu", timer, 2, TINY_BLOCK, context=100, page=32, layers=(2, 6))
    assert ms == pytest.approx(1e3 * (8e-3 - 2e-3) / 4)
    assert timed == [(2, 2)] * 3 + [(6, 2)] * 3
    # one token at position context - 1, a hidden state out, finite (the random weights keep it so)
    assert {s[1:] for s in steps} == {(99, (1, 128), True)}


def test_the_decode_steps_mode_follows_the_environment(monkeypatch):
    assert device_probe.decode_step_mode("cpu") == "eager (no CUDA)"
    monkeypatch.setenv("HELM_CUDA_GRAPHS", "0")
    monkeypatch.setenv("HELM_COMPILE", "1")
    assert device_probe.decode_step_mode("cuda") == "eager (HELM_CUDA_GRAPHS=0), torch.compile"
    monkeypatch.delenv("HELM_CUDA_GRAPHS")
    monkeypatch.delenv("HELM_COMPILE")
    assert device_probe.decode_step_mode("cuda") == "CUDA graph"
