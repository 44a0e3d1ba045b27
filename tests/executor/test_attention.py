"""Streaming paged attention against PyTorch's scaled_dot_product_attention."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from executor import attention
from executor.attention import streaming_attention

TOL = 1e-5  # fp32 throughout: only summation order differs from SDPA


def pages(k, v, page_size):
    """Split [H_kv, S, D] K/V into page chunks, the last one partial."""
    S = k.shape[1]
    return [(k[:, s:s + page_size], v[:, s:s + page_size], s) for s in range(0, S, page_size)]


def reference(q, k, v, causal_positions):
    """q [T, Hq, D], k/v [Hkv, S, D] → [T, Hq, D] via SDPA with K/V repeated per group."""
    T, hq, d = q.shape
    group = hq // k.shape[0]
    kr = k.repeat_interleave(group, dim=0)[None]
    vr = v.repeat_interleave(group, dim=0)[None]
    mask = None
    if causal_positions is not None:
        key_pos = torch.arange(k.shape[1])
        mask = key_pos[None, :] <= causal_positions[:, None]  # True = attend
    out = F.scaled_dot_product_attention(q.permute(1, 0, 2)[None], kr, vr, attn_mask=mask)
    return out[0].permute(1, 0, 2)


@pytest.mark.parametrize("page_size", [1, 16, 512])
@pytest.mark.parametrize("seq_len,num_queries", [(1, 1), (37, 1), (700, 1), (37, 37), (700, 5)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_matches_sdpa(page_size, seq_len, num_queries, heads):
    hq, hkv = heads
    torch.manual_seed(seq_len * 31 + page_size + hq)
    d = 16
    q = torch.randn(num_queries, hq, d)
    k = torch.randn(hkv, seq_len, d)
    v = torch.randn(hkv, seq_len, d)
    # The queries are the last `num_queries` positions; with several queries, mask causally.
    positions = torch.arange(seq_len - num_queries, seq_len) if num_queries > 1 else None
    got = streaming_attention(q, pages(k, v, page_size), 1 / math.sqrt(d), positions)
    want = reference(q, k, v, positions)
    err = (got - want).abs().max().item()
    print(f"page={page_size} S={seq_len} T={num_queries} heads={heads}: max |diff| = {err:.2e} (tol {TOL})")
    assert err < TOL
    if positions is not None:   # told the first query on the host, chunks before it skip the mask: same result
        told = streaming_attention(q, pages(k, v, page_size), 1 / math.sqrt(d), positions,
                                   first_query=seq_len - num_queries)
        assert (told - want).abs().max().item() < TOL


def test_half_precision_pages_are_read_in_fp32():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 8)
    k = torch.randn(2, 40, 8).bfloat16()
    v = torch.randn(2, 40, 8).bfloat16()
    got = streaming_attention(q, pages(k, v, 16), 0.5)
    want = reference(q * 0.5 * math.sqrt(8), k.float(), v.float(), None)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() < TOL


def test_design_example_six_tokens():
    # DESIGN.md §7: scores [2,4,1,0,1,2] over values [10,30,5,2,8,12] give ≈24.2, page by page.
    scores = torch.tensor([2.0, 4, 1, 0, 1, 2])
    values = torch.tensor([10.0, 30, 5, 2, 8, 12])
    q = torch.ones(1, 1, 1)
    k = scores.view(1, 6, 1)
    v = values.view(1, 6, 1)
    for page_size in (1, 2, 4, 6):
        out = streaming_attention(q, pages(k, v, page_size), scale=1.0).item()
        assert out == pytest.approx(24.24, abs=0.01), page_size
    exact = (torch.softmax(scores, 0) * values).sum().item()
    assert streaming_attention(q, pages(k, v, 2), 1.0).item() == pytest.approx(exact, rel=1e-6)


def test_max_rising_late_rescales_earlier_pages():
    # The largest score sits in the last page: earlier partial sums must be rescaled, not lost.
    q = torch.ones(1, 1, 1)
    k = torch.tensor([0.0, 0.0, 0.0, 50.0]).view(1, 4, 1)
    v = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1)
    out = streaming_attention(q, pages(k, v, 1), 1.0).item()
    assert out == pytest.approx(4.0, abs=1e-6)


def test_empty_sequence_is_an_error():
    with pytest.raises(ValueError):
        streaming_attention(torch.ones(1, 1, 4), [], 1.0)


@pytest.mark.parametrize("heads", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("start", [0, 30])
def test_lower_right_causal_attention_matches_sdpa_with_repeated_kv(heads, start):
    """The GPU stage's prompt attention (flash attention on CUDA, with no mask: the causal bias
    aligned to the lower right, GQA as it is) against SDPA with K/V repeated per query head and
    the mask made, on a chunk after cached keys and on a first chunk. Here on the CPU PyTorch
    makes the mask itself; the semantics are the ones CUDA's kernel is asked for."""
    from executor.attention import lower_right_causal_attention

    hq, hkv = heads
    g = torch.Generator().manual_seed(5)
    n, d = 7, 16
    q = torch.randn(n, hq, d, generator=g)
    k, v = torch.randn(hkv, start + n, d, generator=g), torch.randn(hkv, start + n, d, generator=g)
    positions = torch.arange(start, start + n)
    got = lower_right_causal_attention(q.permute(1, 0, 2).contiguous(), k, v, d ** -0.5).permute(1, 0, 2)
    assert (got - reference(q, k, v, positions)).abs().max() < TOL


def test_a_gpu_stage_turns_cudnn_attention_off_for_the_process():
    """PyTorch prefers cuDNN's attention on Hopper, which raises on shapes it has no plan for;
    a GPU stage's attention (TorchAttention on a CUDA KV cache: the loader's stages and the profile's
    decode-block probe alike) leaves flash, memory-efficient and math."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        cpu_kv = SimpleNamespace(device=torch.device("cpu"))
        attention.TorchAttention(SimpleNamespace(head_dim=8), cpu_kv, None)
        assert torch.backends.cuda.cudnn_sdp_enabled()  # a CPU stage leaves the process as it is
        cuda_kv = SimpleNamespace(device=torch.device("cuda"))  # a stand-in: nothing is allocated on it
        attention.TorchAttention(SimpleNamespace(head_dim=8), cuda_kv, None)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_a_half_precision_qkv_projects_as_its_fp32_widening(qk_norm):
    """A GPU stage's qkv projection leaves its product in bf16 (TorchLinear widen=False); the
    q/k norm's input (a widened copy of q/k) or else the rotation's own ops widen it: the same
    q/k as the fp32 reference path gets from the widened product, written into a bf16 buffer or
    returned, and v handed on as it is."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from executor.backends import TorchBackend
    from executor.model_config import ModelConfig
    from executor.rope import inverse_frequencies, rotation_tables

    raw = json.loads((Path(__file__).resolve().parents[2] / "tools/model_configs/qwen3-0.6b.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    if not qk_norm:
        cfg = replace(cfg, qk_norm=False)
    g = torch.Generator().manual_seed(4)
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    qkv = torch.randn(3, heads * cfg.head_dim, generator=g).to(torch.bfloat16)
    norms = (torch.rand(cfg.head_dim, generator=g) + 0.5, torch.rand(cfg.head_dim, generator=g) + 0.5) \
        if qk_norm else (None, None)
    cos, sin = rotation_tables(inverse_frequencies(cfg.rope, cfg.head_dim), torch.tensor([0, 17, 4000]))
    project = attention.TorchAttention(cfg, None, TorchBackend()).project
    want_qk, want_v = project(qkv.float(), *norms, cos, sin)
    got_qk, got_v = project(qkv, *norms, cos, sin)
    assert got_qk.dtype == torch.float32 and torch.equal(got_qk, want_qk)
    assert got_v.dtype == torch.bfloat16 and torch.equal(got_v.float(), want_v)
    out = torch.empty(3, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    project(qkv, *norms, cos, sin, out=out)
    assert torch.equal(out, want_qk.to(torch.bfloat16))


@pytest.mark.parametrize("heads,start,count,page", [((8, 2), 37, 11, 8), ((4, 4), 16, 5, 8), ((6, 1), 3, 9, 4),
                                                    ((8, 2), 0, 7, 8), ((4, 2), 64, 1, 16)])
def test_flash_attention_a_page_at_a_time_is_causal_attention(heads, start, count, page):
    """segmented_prompt_attention (a chunk of a sequence longer than the device pool) against
    attention in float64 with K/V repeated per query head and the causal mask made: cached pages
    (the last one cut at the chunk's start, mid-page or not), GQA groups 1 to 6, no cache at all."""
    h_q, h_kv = heads
    g = torch.Generator().manual_seed(start + count)
    k, v = (torch.randn(h_kv, start + count, 16, generator=g) for _ in range(2))
    q = torch.randn(count, h_q, 16, generator=g)
    cached = [(k[:, a:min(a + page, start)], v[:, a:min(a + page, start)], a) for a in range(0, start, page)]
    got = attention.segmented_prompt_attention(q, cached, k[:, start:].transpose(0, 1), v[:, start:].transpose(0, 1),
                                               start, 0.25)
    group = h_q // h_kv
    scores = torch.einsum("thd,hsd->hts", q.double(), k.double().repeat_interleave(group, 0)) * 0.25
    hidden = torch.arange(start + count)[None, :] > torch.arange(start, start + count)[:, None]
    want = torch.einsum("hts,hsd->thd", scores.masked_fill(hidden, float("-inf")).softmax(-1),
                        v.double().repeat_interleave(group, 0)).reshape(count, h_q * 16)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=2e-6)


def test_the_load_time_check_of_flash_attention_a_page_at_a_time_passes_where_it_serves():
    """segmented_attention_error on the CPU's flash operator: None (it serves) for the shapes the
    models here have, in each cache dtype; its answer is kept per shape."""
    from executor.attention import _SEGMENTED_CHECKED, segmented_attention_error

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert segmented_attention_error(torch.device("cpu"), dtype, 16, 8, 128) is None
    assert (torch.device("cpu"), torch.bfloat16, 16, 8, 128) in _SEGMENTED_CHECKED


def test_the_load_time_check_finds_an_operator_whose_log_sum_exp_differs(monkeypatch):
    """Where the flash operator's log-sum-exp is not what the merge assumes (here: in log2 units),
    the check says so, and its answer is the stage's reason to stream."""
    flash = attention.flash_segment

    def log2_units(*args):
        out, lse = flash(*args)
        return out, lse / math.log(2)

    monkeypatch.setattr(attention, "_SEGMENTED_CHECKED", {})
    monkeypatch.setattr(attention, "flash_segment", log2_units)
    why = attention.segmented_attention_error(torch.device("cpu"), torch.float32, 8, 2, 64)
    assert why is not None and why.startswith("its output is ") and "from fp32 attention's" in why


def test_the_load_time_check_keeps_no_out_of_memory_answer(monkeypatch):
    """A check that ran out of memory (a load beside another plan) says so for that load, and the
    next load checks again rather than streaming for the rest of the process."""
    flash, failures = attention.flash_segment, [1]

    def short_of_memory_once(*args):
        if failures:
            failures.pop()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return flash(*args)

    monkeypatch.setattr(attention, "_SEGMENTED_CHECKED", {})
    monkeypatch.setattr(attention, "flash_segment", short_of_memory_once)
    shape = (torch.device("cpu"), torch.float32, 8, 2, 64)
    assert attention.segmented_attention_error(*shape).startswith("OutOfMemoryError")
    assert attention._SEGMENTED_CHECKED == {}
    assert attention.segmented_attention_error(*shape) is None and attention._SEGMENTED_CHECKED == {shape: None}
