"""The attention-side kernels (q/k RMSNorm + RoPE, KV write into pages, paged attention) and the
fused residual add of `linear`, in every variant this machine can run, against the fp32
reference twins in executor/kernels/reference.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import executor.kernels as K
from executor.backends import KernelAttention
from executor.kv_cache import KVCache
from executor.kernels.reference import causal_attention_ref, linear_ref, rope_qk_ref

ISAS_HERE = K.available_isas()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = lambda d: str(d).removeprefix("torch.")  # noqa: E731

# Attention: max |out − ref| / max |v|: an fp32 softmax-weighted mean; our exp is ~1-2 ulp.
ATTENTION_TOL = 2e-6
# Prompt chunks (PyTorch's flash attention), max |out − ref| / max |v|: fp32 math for fp32 and
# fp16 caches, measured ≤ 1.4e-7; a bf16 cache rounds queries and output to bf16's 8 significant
# bits: bounded by one unit of that precision, 2^-8 (measured ≤ 1.9e-3).
PROMPT_ATTENTION_TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 1e-6}
# q/k RMSNorm: allclose (rtol, atol) as the rms_norm kernel; the rotation alone is exact.
ROPE_NORM_TOL = (1e-5, 1e-6)


def _tables(T: int, D: int, start: int = 3):
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.arange(start, start + T).float()[:, None] * inv[None, :]
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("D", [2, 6, 16, 48, 128])
def test_rope_qk_matches_reference(isa, D):
    ks = K.KernelSet(isa)
    gen = torch.Generator().manual_seed(D)
    hq, hkv, T = 5, 3, 7
    width = (hq + 2 * hkv) * D
    base = torch.randn(T, width + 5, generator=gen)[:, :width]  # strided rows
    cos, sin = _tables(T, D)
    qn, kn = torch.randn(D, generator=gen), torch.randn(D, generator=gen)
    for threads in (1, 2):
        plain = ks.rope_qk_(base.clone(), hq, hkv, cos, sin, num_threads=threads)
        # Same products and differences as the reference, rounded the same way: bit-identical.
        assert torch.equal(plain, rope_qk_ref(base, hq, hkv, cos, sin)), f"{isa} D={D}"
        normed = ks.rope_qk_(base.clone(), hq, hkv, cos, sin, qn, kn, 1e-6, num_threads=threads)
        ref = rope_qk_ref(base, hq, hkv, cos, sin, qn, kn, 1e-6)
        torch.testing.assert_close(normed, ref, rtol=ROPE_NORM_TOL[0], atol=ROPE_NORM_TOL[1])
        # V heads are untouched.
        assert torch.equal(normed[:, (hq + hkv) * D:], base[:, (hq + hkv) * D:])


def _pages(layout, n: int, gen):
    """n page buffers filled with garbage, in scrambled memory order, and their address table."""
    shape = (layout.num_layers, 2, layout.num_kv_heads, layout.page_size, layout.head_dim)
    bufs = [torch.randn(shape, generator=gen).to(layout.dtype) for _ in range(n + 2)][::-1][:n]
    return bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kv_write_rounds_like_torch(isa, dtype):
    """K/V land in the right page, slot, layer and head, converted exactly as Tensor.to(dtype)
    converts (round to nearest even, overflow to inf, NaN stays NaN)."""
    ks = K.KernelSet(isa)
    gen = torch.Generator().manual_seed(2)
    hq, hkv, D, P, L = 4, 2, 24, 5, 3
    layout = K.PagedKV(L, hkv, P, D, dtype)
    bufs, table = _pages(layout, 4, gen)
    start, T = 3, 11  # spans pages 0..2, starting mid-page
    qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=gen) * 3
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 65520.0, 7e4, -1e-7, 3e-8, 1e-45,
                            1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11])
    qkv[0, hq * D: hq * D + special.numel()] = special
    ks.kv_write(qkv, layout, table, 1, start, hq)
    kv = qkv[:, hq * D:].reshape(T, 2, hkv, D)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for t in range(T):
        page, slot = bufs[(start + t) // P], (start + t) % P
        got, expected = page[1, :, :, slot], kv[t].to(dtype)  # [2, Hkv, D] of layer 1
        nan = expected.isnan()  # any NaN will do (PyTorch's own bf16 NaN bits vary by code path)
        assert torch.equal(got.isnan(), nan), f"{isa} {dtype} token {t}: NaNs differ"
        assert torch.equal(got[~nan].view(bits), expected[~nan].view(bits)), f"{isa} {dtype} token {t}"


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv,D,P,start,T", [
    (1, 1, 8, 4, 0, 1),  # first token
    (4, 2, 16, 3, 10, 1),  # decode over 4 pages, the last one partial
    (8, 2, 48, 16, 40, 5),  # several queries (chunked prefill), D with a scalar tail under avx2
    (6, 6, 20, 7, 0, 9),  # MHA, prefill from position 0, D below one AVX-512 vector
    (16, 8, 128, 64, 150, 3),  # Qwen3-0.6B heads, blocks of 64 keys across pages
    (4, 1, 64, 512, 600, 2),  # one KV head for 4 query heads, 512-token pages
    (12, 2, 32, 16, 70, 2),  # 6 query heads per KV head: a pass of 4 heads, then one of 2
    (7, 1, 24, 8, 33, 3),  # 7 per KV head: 4, then 3 (Qwen2-7B's ratio), D with a scalar tail
    (4, 1, 32, 256, 2100, 1),  # 2101 keys: 2 segments (helm_att_split), one KV head (MQA)
    (6, 2, 16, 512, 3500, 4),  # 8 (head, row) pairs: 2 segments, the early rows' first ones shorter
    (2, 1, 8, 64, 17000, 1),  # the cap: 16 segments
])
def test_paged_attention_matches_reference(isa, dtype, hq, hkv, D, P, start, T):
    ks = K.KernelSet(isa)
    gen = torch.Generator().manual_seed(start + T + D)
    L, layer = 2, 1
    layout = K.PagedKV(L, hkv, P, D, dtype)
    bufs, table = _pages(layout, -(-(start + T) // P) + 1, gen)  # one spare page at the end
    history = torch.randn(start, (hq + 2 * hkv) * D, generator=gen)
    qkv = torch.randn(T, (hq + 2 * hkv) * D + 3, generator=gen)[:, :(hq + 2 * hkv) * D]
    if start:
        ks.kv_write(history, layout, table, layer, 0, hq)
    ks.kv_write(qkv, layout, table, layer, start, hq)
    every = torch.cat([history, qkv])[:, hq * D:].reshape(start + T, 2, hkv, D).to(dtype)
    ref = causal_attention_ref(qkv[:, :hq * D].reshape(T, hq, D), every[:, 0], every[:, 1], start, D ** -0.5)
    scale = every[:, 1].float().abs().max()
    outs = []
    for threads in (1, 2):
        out = torch.full((T, hq * D), float("nan"))
        ks.paged_attention(qkv, out, layout, table, layer, start, hq, D ** -0.5, num_threads=threads)
        err = ((out.reshape(T, hq, D) - ref).abs().max() / scale).item()
        assert err <= ATTENTION_TOL, f"{isa} {dtype} threads={threads}: {err:.2e} > {ATTENTION_TOL:.0e}"
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "the result depends on the thread count"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv,D,P,start,T", [
    (4, 2, 16, 8, 0, 20),  # from position 0: the square causal mask
    (4, 2, 16, 8, 13, 21),  # after a cached prefix, pages split mid-chunk
    (16, 8, 128, 64, 150, 40),  # Qwen3-0.6B heads
    (6, 6, 20, 7, 30, 17),  # MHA, D below one AVX-512 vector
])
def test_prompt_attention_matches_reference(dtype, hq, hkv, D, P, start, T):
    """Chunks longer than the attention kernel takes: PyTorch's fused attention over the gathered
    pages, queries in the KV dtype, against the fp32 reference with fp32 queries."""
    gen = torch.Generator().manual_seed(start + T + D)
    layer = 1
    kv = KVCache(2, hkv, D, dtype, torch.device("cpu"), P, 64, 1.0)
    kv.reserve("s", start + T)
    att = KernelAttention(SimpleNamespace(num_heads=hq, num_kv_heads=hkv, head_dim=D, q_dim=hq * D), kv, K, 2,
                          max_queries=16)
    history = torch.randn(start, (hq + 2 * hkv) * D, generator=gen)
    qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=gen)
    table = kv.page_table("s")
    if start:
        K.kv_write(history, att.layout, table, layer, 0, hq)
    K.kv_write(qkv, att.layout, table, layer, start, hq)
    every = torch.cat([history, qkv])[:, hq * D:].reshape(start + T, 2, hkv, D).to(dtype)
    ref = causal_attention_ref(qkv[:, :hq * D].reshape(T, hq, D), every[:, 0], every[:, 1], start, D ** -0.5)
    assert not att.uses_kernel(T)
    got = att.prompt_attention(qkv[:, :hq * D], layer, "s", start).float()
    err = ((got.reshape(T, hq, D) - ref).abs().max() / every[:, 1].float().abs().max()).item()
    assert err <= PROMPT_ATTENTION_TOL[dtype], f"{dtype}: {err:.2e} > {PROMPT_ATTENTION_TOL[dtype]:.0e}"


def test_paged_attention_argument_errors():
    layout = K.PagedKV(2, 2, 4, 8, torch.bfloat16)
    bufs, table = _pages(layout, 2, torch.Generator().manual_seed(0))
    qkv = torch.randn(3, (4 + 4) * 8)
    out = torch.empty(3, 32)
    with pytest.raises(ValueError, match="do not cover"):
        K.kv_write(qkv, layout, table, 0, 6, 4)  # positions 6..8 need 3 pages
    with pytest.raises(ValueError, match="layer 2 out of range"):
        K.paged_attention(qkv, out, layout, table, 2, 0, 4, 0.3, num_threads=1)
    with pytest.raises(ValueError, match="not a multiple"):
        K.kv_write(qkv, layout, table, 0, 0, 3)
    with pytest.raises(ValueError, match="columns"):
        K.kv_write(qkv[:, :40], layout, table, 0, 0, 4)
    with pytest.raises(ValueError, match="out must be"):
        K.paged_attention(qkv, torch.empty(3, 16), layout, table, 0, 0, 4, 0.3, num_threads=1)
    with pytest.raises(ValueError, match="int64"):
        K.kv_write(qkv, layout, table.int(), 0, 0, 4)
    with pytest.raises(TypeError, match="not supported"):
        K.PagedKV(2, 2, 4, 8, torch.int8)
    cos, sin = _tables(3, 8)
    with pytest.raises(ValueError, match="both"):
        K.rope_qk_(qkv, 4, 2, cos, sin, torch.ones(8), None)
    with pytest.raises(ValueError, match="rows"):
        K.rope_qk_(qkv, 4, 2, cos[:2], sin[:2])


@pytest.mark.parametrize("path", K.PROMPT_PATHS)
@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_accumulate_adds_into_out(isa, dtype, path):
    """accumulate=True: out += x Wᵀ + b, the same bits as computing y and then out + y, below
    and above MAX_TILE_B on every route (K = 70: one GEMM panel; over several panels the GEMM
    adds each panel's sum into out in turn, see helm_gemm_fn; fp16 weights never take "torch")."""
    if (path, dtype) == ("torch", torch.float16):
        return
    ks = K.KernelSet(isa, routes={dtype: (path, K.MAX_TILE_B + 1)})
    gen = torch.Generator().manual_seed(5)
    w = K.prepare_linear(torch.randn(37, 70, generator=gen).to(dtype), torch.randn(37, generator=gen))
    for b in (1, 3, 8, 40):
        x, residual = torch.randn(b, 70, generator=gen), torch.randn(b, 37, generator=gen)
        expected = residual + ks.linear(x, w, num_threads=2)
        got = residual.clone()
        assert ks.linear(x, w, got, num_threads=2, accumulate=True) is got
        assert torch.equal(got, expected), f"{isa} {dtype} B={b}"
        # Within the linear tolerance of test_kernels.py (the "torch" route rounds like oneDNN).
        scale = (x.abs() @ w.weight.float().abs().t()).max()
        assert (got - residual - linear_ref(x, w.weight, w.bias)).abs().max() <= 8e-3 * scale
    with pytest.raises(ValueError, match="needs out"):
        ks.linear(x, w, num_threads=1, accumulate=True)
