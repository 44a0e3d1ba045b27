"""executor/device_probe.py: the GPU stage's figures the profile records, measured through the
executor's own code. Here its code runs on CPU tensors (no CUDA graphs); what is checked is
what it times and how the figure follows from the timings."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from executor import device_probe
from executor.device_step import ResidentDecode
from executor.kv_cache import KVCache

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

    ms, how = device_probe.decode_block_ms("cpu", timer, 2, TINY_BLOCK, context=100, page=32, layers=(2, 6))
    assert ms == pytest.approx(1e3 * (8e-3 - 2e-3) / 4) and how == "eager (no CUDA)"
    assert timed == [(2, 2)] * 3 + [(6, 2)] * 3
    # one token at position context - 1, a hidden state out, finite (the random weights keep it so)
    assert {s[1:] for s in steps} == {(99, (1, 128), True)}


def test_the_probe_gives_back_what_it_allocated():
    """Nothing of the probe's stages outlives it (on a GPU: usable VRAM is read after it)."""
    def alive():
        return sum(isinstance(o, (ResidentDecode, KVCache)) for o in gc.get_objects())

    gc.collect()
    before = alive()
    device_probe.decode_block_ms("cpu", lambda fn, reps: (fn(), 1e-3)[1], 1, TINY_BLOCK, context=64, page=32,
                                 layers=(1, 2))
    assert alive() == before


def test_a_static_decode_step_is_freed_when_dropped_without_a_collection():
    """Uncompiled, the GPU stage's step holds no reference cycle: a daemon unloading a plan gets
    its KV slab and graphs back at once, not at the next garbage collection."""
    from executor.backends import TorchBackend
    from executor.model_config import ModelConfig
    from executor.stage import Stage

    cfg = ModelConfig.from_dict(TINY_BLOCK)
    ops = TorchBackend()
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=32, dtype=cfg.dtype, device="cpu", page_size=16,
                 device_pages=2, host_pages=0, slab=True)
    stage = Stage(cfg, 1, 2, torch.device("cpu"), None, [device_probe._block(cfg, torch.device("cpu"), ops)], None,
                  kv, ops)
    assert isinstance(stage.fused, ResidentDecode)
    step, slab = weakref.ref(stage.fused), weakref.ref(kv.device_pool.slab)
    del stage, kv
    gc.disable()
    try:
        assert step() is None and slab() is None
    finally:
        gc.enable()
