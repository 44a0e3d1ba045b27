"""The GPU stage on a real CUDA device (skipped on machines without one).

On CPU-only machines the GPU-side stage runs the same code on the CPU (the other tests); these
tests run it on CUDA: hand-off through a pinned buffer, VRAM pages evicted to pinned host memory
and streamed back on the copy stream.
"""
import pytest
import torch

from tests.executor.helpers import helm_generate, helm_teacher_forced_logits, hf_model, prompt_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
def test_split_on_cuda_matches_cpu_tokens_fp32(checkpoint, arch):
    path = checkpoint(arch, "fp32")
    prompts = [prompt_ids(20, 256, seed=1), prompt_ids(9, 256, seed=2)]
    cpu_only, _ = helm_generate(path, prompts, max_new_tokens=24)
    for split in (0, 3):
        got, model = helm_generate(path, prompts, split=split, max_new_tokens=24)
        assert model.stages[-1].device.type == "cuda"
        assert got == cpu_only


def test_eviction_and_streaming_on_cuda(checkpoint):
    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(30, 256, seed=3), prompt_ids(12, 256, seed=4)]
    want, _ = helm_generate(path, prompts, split=1, max_new_tokens=24)
    got, model = helm_generate(path, prompts, split=1, max_new_tokens=24, page_size=4, device_kv_pages=3)
    assert model.stages[1].kv.stats().evictions > 5
    assert got == want


def test_bf16_logits_on_cuda_close_to_fp32_reference(checkpoint):
    path = checkpoint("llama", "bf16")
    ids = prompt_ids(52, 256, seed=5)
    with torch.no_grad():
        want = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0].float()
    got = helm_teacher_forced_logits(path, ids, prefill=20, split=1)
    # The CUDA stage multiplies in bf16 (fp32 accumulation): looser than the CPU path's bound.
    assert (got - want).abs().max().item() < 2.0


def test_cuda_stage_is_timed_with_events(checkpoint):
    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.placement import Placement
    from executor.sampling import StopCriteria

    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    engine = Engine(load_model(path, Placement.from_split(cfg.num_units, 2), cfg))
    engine.generate([[11, 12, 13]], stop=StopCriteria(max_new_tokens=3))
    cpu, cuda = engine.last_step.stages
    assert (cpu.device, cuda.device) == ("cpu", "cuda") and cpu.ms > 0 and cuda.ms > 0
