"""HELM's tokens and logits against Hugging Face transformers on the same checkpoints.

The `checkpoint` fixture (tests/conftest.py) builds tiny random-weight checkpoints of each family
with tools/make_model.py; transformers loads the very same directory.
"""
import pytest
import torch

from executor.loader import resolve_backend
from executor.request_params import SamplingParams
from tests.executor.helpers import (helm_generate, helm_teacher_forced_logits, hf_greedy, hf_model,
                                    prompt_ids)

FAMILIES = ["qwen3", "llama", "qwen2", "mistral"]
# CPU-stage backends: our kernels (when built) and the PyTorch reference path.
BACKENDS = ["helm", "torch"] if resolve_backend("auto") == "helm" else ["torch"]

# Max |logit difference| against transformers in fp32 on the same (upcast) weights, per dtype.
# HELM keeps activations and accumulation in fp32, so the weights enter exactly; the one extra
# rounding is the KV cache, stored in the weight dtype (with an fp32 KV cache the difference is
# ~6e-5). bf16 keeps 8 significant bits, fp16 11: hence the 8x between the two bounds. Measured
# on the tiny checkpoints (4 families x 3 seeds, logit std ~3): bf16 0.22-0.97, fp16 0.02-0.11,
# while transformers' own bf16/fp16 runs land 0.70-1.28 / 0.08-0.26 from its fp32 run.
LOGIT_TOL = {"bf16": 1.25, "fp16": 0.16}


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_fp32_matches_transformers_generate(checkpoint, arch):
    path = checkpoint(arch, "fp32")
    prompt = prompt_ids(20, 256, seed=1)
    want = hf_greedy(path, prompt, 32)
    assert len(want) == 32
    for backend in BACKENDS:
        got, model = helm_generate(path, [prompt], max_new_tokens=32, backend=backend)
        assert model.stages[0].backend == backend
        assert got[0] == want, backend


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_half_precision_logits_match_fp32_reference(checkpoint, arch, dtype):
    path = checkpoint(arch, dtype)
    ids = prompt_ids(52, 256, seed=2)
    with torch.no_grad():
        want = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0].float()
        half = hf_model(path, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
        own_err = (half(torch.tensor([ids])).logits[0].float() - want).abs().max().item()
    tol = LOGIT_TOL[dtype]
    top2 = want.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > tol
    assert decided.sum() >= 5  # the argmax check below is not vacuous
    for backend in BACKENDS:
        got = helm_teacher_forced_logits(path, ids, prefill=20, backend=backend)
        err = (got - want).abs().max().item()
        print(f"{arch} {dtype} {backend}: max |logit diff| = {err:.3f} (tolerance {tol}; transformers in "
              f"{dtype}: {own_err:.3f}), logit std {want.std():.2f}")
        assert err < tol
        assert err < own_err  # never further from fp32 than transformers' own half-precision run
        # Argmax agrees wherever the reference's top-2 margin exceeds the tolerance.
        assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_split_and_forced_eviction_give_identical_tokens(checkpoint, arch):
    path = checkpoint(arch, "fp32")
    prompts = [prompt_ids(20, 256, seed=3), prompt_ids(7, 256, seed=4)]
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=123)
    for sampling in (None, seeded):
        base, model = helm_generate(path, prompts, sampling=sampling)
        units = model.config.num_units
        for k in (0, 1, units // 2, units - 1, units):
            got, _ = helm_generate(path, prompts, split=k, sampling=sampling)
            assert got == base, f"split k={k}"
        # A GPU-side KV pool of 3 pages of 4 tokens: pages are evicted to the host and
        # attention streams them back, for both sequences at once.
        got, model = helm_generate(path, prompts, split=1, sampling=sampling, page_size=4, device_kv_pages=3)
        kv = model.stages[1].kv.stats()
        assert kv.evictions > 5
        assert kv.device_pages_used == 0 and kv.host_pages_used == 0  # all freed at the end
        assert got == base


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_batch_of_four_equals_four_single_runs(checkpoint, arch):
    path = checkpoint(arch, "fp32")
    prompts = [prompt_ids(n, 256, seed=10 + n) for n in (3, 11, 20, 34)]
    for sampling in (None, SamplingParams(temperature=1.0, top_k=20, seed=5)):
        batched, _ = helm_generate(path, prompts, split=2, sampling=sampling, max_new_tokens=24, page_size=8)
        singles = [helm_generate(path, [p], split=2, sampling=sampling, max_new_tokens=24, page_size=8)[0][0]
                   for p in prompts]
        assert batched == singles


def test_chunked_prefill_equals_one_shot_prefill(checkpoint):
    path = checkpoint("qwen3", "fp32")
    prompt = prompt_ids(40, 256, seed=6)
    one_shot, _ = helm_generate(path, [prompt], max_new_tokens=8)
    chunked, _ = helm_generate(path, [prompt], max_new_tokens=8, prefill_chunk=7, page_size=8)
    assert chunked == one_shot


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [512, 40])
def test_long_prompt_matches_transformers(checkpoint, backend, chunk):
    """A 90-token prompt: with the kernels, one-shot prefill runs PyTorch's fused attention from
    position 0; chunks of 40 the same over the cached pages, then the last 10 (the attention kernel's
    where this machine measured it faster for 10 queries): every route gives transformers' greedy
    tokens."""
    path = checkpoint("llama", "fp32")
    prompt = prompt_ids(90, 256, seed=9)
    want = hf_greedy(path, prompt, 12)
    got, _ = helm_generate(path, [prompt], max_new_tokens=12, backend=backend, prefill_chunk=chunk, page_size=16)
    assert got[0] == want
