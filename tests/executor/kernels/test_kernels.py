"""Every CPU kernel, in every variant this machine can run, against its fp32 reference twin
(executor/kernels/reference.py) on odd shapes, with 1 and 2 threads; plus ISA dispatch.

Errors are printed next to a named tolerance per dtype (shown by pytest on failure, or with -s).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import executor.kernels as K
from executor.kernels.reference import linear_ref, rms_norm_ref, silu_mul_ref

ISAS_HERE = K.available_isas()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
THREADS = (1, 2)

# Max |y − ref| / max(|x| @ |W|ᵀ): the error of an fp32 dot product relative to the size of its
# terms. Our kernels land near 2e-7; the avx512bf16 variant, which multiplies bf16 weights by x
# split into two bf16 halves (≈16 mantissa bits of x), near 2e-6.
LINEAR_TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
# The "torch" route on the weight's own dtype: fp32 stays exact (MKL); bf16 and fp16 run oneDNN's
# GEMM, which rounds x and the result to that dtype (unit roundoff 2^-8 / 2^-11 each, relative).
LINEAR_TOL_TORCH = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# Element-wise ops: allclose tolerances (rtol, atol) against the fp32 reference.
RMS_NORM_TOL = (1e-5, 1e-6)
SILU_MUL_TOL = (1e-5, 1e-6)  # our exp is ~1–2 ulp, torch's ~1 ulp

# (N, K): K = 1, K below one vector, odd K (vector loop + scalar tail), N below and above a tile,
# K a multiple of the vector width, and one shape spanning several L2 blocks for B > 8 (B = 12:
# ours in L2 blocks for every dtype; 17: PyTorch for bf16).
LINEAR_SHAPES = [(1, 1), (5, 1), (3, 7), (37, 33), (67, 129), (130, 1000), (64, 256), (301, 2051)]
BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 17, 40)


def _rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> float:
    scale = (x.abs() @ w.float().abs().t()).max().clamp_min(1e-30)
    return ((y - ref).abs().max() / scale).item()


@pytest.mark.parametrize("path", K.PROMPT_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("isa", ISAS_HERE)
def test_linear_matches_reference(isa, dtype, path):
    """Every route batches above MAX_TILE_B can take (from 12 rows here), every dtype, every ISA
    this CPU runs (for fp32 weights "torch_fp32" is the "torch" call; fp16 weights never take
    "torch", whose fp16 product can overflow: test_routes_are_checked)."""
    if (path, dtype) == ("torch", torch.float16):
        return
    ks = K.KernelSet(isa, routes={dtype: (path, 12)})
    gen = torch.Generator().manual_seed(1)
    worst = {}
    for n, k in LINEAR_SHAPES:
        weight = torch.randn(n, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen) if n % 2 else None
        prepared = K.prepare_linear(weight, bias)
        for b in BATCHES:
            if path != "gemv" and b <= K.MAX_TILE_B:
                continue  # the GEMV tiles whatever the route: identical to the "gemv" run
            taken = ks.path(dtype, b)
            assert taken == ("gemv" if b < 12 else path)
            tol = (LINEAR_TOL_TORCH if taken == "torch" else LINEAR_TOL)[dtype]
            x = torch.randn(b, k, generator=gen)
            ref = linear_ref(x, weight, bias)
            ys = [ks.linear(x, prepared, num_threads=t) for t in THREADS]
            err = _rel_err(ys[0], x, weight, ref)
            worst[taken, tol] = max(worst.get((taken, tol), 0.0), err)
            assert err <= tol, f"{isa} {dtype} {taken} N={n} K={k} B={b}: {err:.2e} > {tol:.0e}"
            residual = torch.randn(b, n, generator=gen)
            acc = ks.linear(x, prepared, residual.clone(), num_threads=2, accumulate=True)
            err = _rel_err(acc - residual, x, weight, ref)
            assert err <= 2 * tol, f"{isa} {dtype} {taken} accumulate N={n} K={k} B={b}: {err:.2e}"
            if taken in ("gemv", "gemm"):
                # Each output is computed by one thread in a fixed order: threads change nothing.
                for y in ys[1:]:
                    assert torch.equal(y, ys[0]), f"{isa} {dtype} {taken} N={n} K={k} B={b}: threads differ"
    for (taken, tol), err in worst.items():
        print(f"linear {isa} {dtype} {taken}: max err {err:.2e} (tolerance {tol:.0e})")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("isa", ISAS_HERE)
def test_gemm_panels_and_blocks(isa, dtype):
    """The packed GEMM across its blocking edges: K over several panels (GEMM_KC: 256 to 1024
    columns by ISA) with a ragged last one, N over several 128-row packs with a partial micro-tile,
    M over a whole row block (GEMM_MB: 576 rows on 16-register ISAs) plus a partial one; a row's
    result does not depend on how many rows share the call."""
    ks = K.KernelSet(isa)
    gen = torch.Generator().manual_seed(7)
    n, k = 301, 2100
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    prepared = K.prepare_linear(weight, bias)
    x = torch.randn(1200, k, generator=gen)
    y = ks.gemm(x, prepared, num_threads=2)
    err = _rel_err(y, x, weight, linear_ref(x, weight, bias))
    assert err <= LINEAR_TOL[dtype], f"{isa} {dtype}: {err:.2e}"
    assert torch.equal(ks.gemm(x[:37], prepared, num_threads=1), y[:37])
    assert torch.equal(ks.gemm(x[1190:], prepared, num_threads=3), y[1190:])


def test_routes_are_checked():
    with pytest.raises(ValueError, match="unknown GEMM path"):
        K.KernelSet("portable", routes={torch.bfloat16: ("blas", 16)})
    with pytest.raises(ValueError, match="min_rows"):
        K.KernelSet("portable", routes={torch.bfloat16: ("gemm", K.MAX_TILE_B)})
    with pytest.raises(TypeError):
        K.KernelSet("portable", routes={torch.int8: ("gemm", 16)})
    with pytest.raises(ValueError, match="can overflow"):  # a profile or plan edited by hand
        K.KernelSet("portable", routes={torch.float16: ("torch", 16)})


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_linear_threads_cover_every_row_once(dtype):
    """Threads that finish early take tiles from the others' shares (helm_claim): whoever computes
    a row, every row is written exactly once and with the same bits as with one thread."""
    gen = torch.Generator().manual_seed(4)
    prepared = K.prepare_linear(torch.randn(1003, 300, generator=gen).to(dtype),
                                torch.randn(1003, generator=gen))
    for b in (1, 3, 8):
        x = torch.randn(b, 300, generator=gen)
        ref = K.linear(x, prepared, num_threads=1)
        out = torch.empty(b, 1003)
        for i in range(60):
            out.fill_(float("nan"))
            K.linear(x, prepared, out=out, num_threads=2 + i % 3)  # 2..4 threads on any core count
            assert torch.equal(out, ref), f"B={b} run {i}"


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_weight_conversions_exact(isa):
    """bf16/fp16 → fp32 widening in every load path (vector body, pair loads, scalar tail) is exact,
    subnormals and extremes included: one-hot rows of x pick single weights out unchanged."""
    ks = K.KernelSet(isa)
    k = 67  # vector body + pairs + a scalar tail on every ISA
    specials = {
        torch.float16: [6e-8, -6e-8, 6.1e-5, 6.0e-5, 65504.0, -65504.0, -0.0, 1.0, 0.333, 2.0 ** -24],
        torch.bfloat16: [1e-40, -1e-40, 1.2e-38, 3.3e38, -3.3e38, -0.0, 1.0, 0.333, 2.0 ** -126],
    }
    for dtype, values in specials.items():
        v = torch.tensor(values).to(dtype)
        weight = v[torch.arange(7 * k) % len(v)].reshape(7, k)  # [N=7, K] every special everywhere
        prepared = K.prepare_linear(weight)
        for b in (1, 3, 8):
            cols = torch.tensor([(5 * i + b) % k for i in range(b)])
            x = torch.nn.functional.one_hot(cols, k).float()  # [B, K]
            y = ks.linear(x, prepared, num_threads=1)
            expected = weight.float()[:, cols].t()
            if isa == "avx512bf16" and dtype == torch.bfloat16:
                # VDPBF16PS reads subnormal inputs as zero (DAZ); only the scalar tail keeps them.
                flush = (expected.abs() < 2.0 ** -126) & (cols < k - k % 32)[:, None]
                expected = torch.where(flush, torch.zeros_like(expected), expected)
            assert torch.equal(y, expected + 0.0), f"{isa} {dtype} B={b}"  # +0.0: -0 sums to +0


def test_linear_out_buffer_and_errors():
    weight = torch.randn(33, 17)
    prepared = K.prepare_linear(weight)
    x = torch.randn(3, 17)
    out = torch.full((3, 33), float("nan"))
    assert K.linear(x, prepared, out=out, num_threads=2) is out
    assert torch.allclose(out, linear_ref(x, weight), rtol=1e-5, atol=1e-5)
    assert K.linear(torch.empty(0, 17), prepared, num_threads=1).shape == (0, 33)
    with pytest.raises(ValueError):
        K.linear(torch.randn(3, 16), prepared, num_threads=1)  # wrong K
    with pytest.raises(ValueError):
        K.linear(x.double(), prepared, num_threads=1)
    with pytest.raises(ValueError):
        K.linear(torch.randn(17, 3).t(), prepared, num_threads=1)  # not contiguous
    with pytest.raises(ValueError):
        K.linear(x, prepared, out=torch.empty(3, 32), num_threads=1)
    square = K.prepare_linear(torch.randn(17, 17))
    with pytest.raises(ValueError, match="out overlaps x"):  # rows would be read after being written
        K.linear(x, square, out=x, num_threads=1)
    with pytest.raises(ValueError, match="out overlaps x"):
        both = torch.randn(4, 17)
        K.linear(both[:3], square, out=both[1:], num_threads=1)
    with pytest.raises(TypeError):
        K.prepare_linear(torch.ones(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError):
        K.prepare_linear(torch.ones(4, 4), torch.ones(5))
    with pytest.raises(TypeError):
        K.linear(x, prepared)  # num_threads is required
    # A non-contiguous weight is made contiguous once, at prepare time.
    wt = torch.randn(17, 33).t()
    assert torch.allclose(K.linear(x, K.prepare_linear(wt), num_threads=1), linear_ref(x, wt),
                          rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_rms_norm_matches_reference(isa):
    ks = K.KernelSet(isa)
    gen = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        for rows, h in [(1, 1), (1, 7), (3, 128), (17, 1000), (2, 4099)]:
            x = torch.randn(rows, h, generator=gen) * 3
            w = (torch.randn(h, generator=gen)).to(dtype)
            ref = rms_norm_ref(x, w, 1e-6)
            for t in THREADS:
                y = ks.rms_norm(x, w, 1e-6, num_threads=t)
                torch.testing.assert_close(y, ref, rtol=RMS_NORM_TOL[0], atol=RMS_NORM_TOL[1])
    # [T, heads, D] (Qwen3's per-head q/k norm) and in place.
    x = torch.randn(5, 16, 128, generator=gen)
    w = torch.randn(128, generator=gen)
    ref = rms_norm_ref(x, w, 1e-6)
    y = ks.rms_norm(x, w, 1e-6, out=x, num_threads=2)
    assert y is x
    torch.testing.assert_close(y, ref, rtol=RMS_NORM_TOL[0], atol=RMS_NORM_TOL[1])


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_silu_mul_matches_reference(isa):
    ks = K.KernelSet(isa)
    gen = torch.Generator().manual_seed(3)
    for rows, n in [(1, 1), (1, 13), (3, 3072), (17, 100)]:
        gate = torch.randn(rows, n, generator=gen) * 4
        up = torch.randn(rows, n, generator=gen)
        ref = silu_mul_ref(gate, up)
        for t in THREADS:
            torch.testing.assert_close(ks.silu_mul(gate, up, num_threads=t), ref,
                                       rtol=SILU_MUL_TOL[0], atol=SILU_MUL_TOL[1])
    # Extremes: exp overflow/underflow must give silu's limits, not inf/NaN.
    # Far below exp's range the product goes to -0 (it went to -g/exp(88.7): -0.9 at -3e38).
    gate = torch.tensor([[-3e38, -1e37, -1e4, -200.0, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 89.0,
                          200.0, 1e4, 3e38, float("nan"), float("-inf")]])
    up = torch.full_like(gate, 1.5)
    torch.testing.assert_close(ks.silu_mul(gate, up), silu_mul_ref(gate, up),
                               rtol=SILU_MUL_TOL[0], atol=SILU_MUL_TOL[1], equal_nan=True)
    # The two halves of a fused gate_up output: strided row views, no copy needed.
    gate_up = torch.randn(4, 2 * 96, generator=gen)
    gate, up = gate_up.split(96, dim=-1)
    torch.testing.assert_close(ks.silu_mul(gate, up, num_threads=2), silu_mul_ref(gate, up),
                               rtol=SILU_MUL_TOL[0], atol=SILU_MUL_TOL[1])
    x1 = torch.randn(50, generator=gen)  # 1-D
    torch.testing.assert_close(ks.silu_mul(x1, x1), silu_mul_ref(x1, x1),
                               rtol=SILU_MUL_TOL[0], atol=SILU_MUL_TOL[1])


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_read_pass_checksum(isa):
    buf = torch.arange(1 << 16, dtype=torch.int64)
    expected = int(buf.sum())  # the probe sums 64-bit words
    assert K.KernelSet(isa).read_pass(buf, num_threads=2) == expected


def test_one_openmp_runtime():
    """The extension shares torch's libgomp instead of loading a second OpenMP runtime."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc (Linux)")
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes


def test_isa_env_dispatch_and_missing_extension():
    """HELM_KERNEL_ISA forces each variant; a bad or unrunnable value is an error; without the
    compiled extension the import fails with a clear ImportError. One subprocess for all."""
    script = textwrap.dedent("""
        import importlib, os, sys
        import executor.kernels as K
        results = {"default": K.KERNEL_ISA}
        for isa in K.ISAS + ("bogus",):
            os.environ["HELM_KERNEL_ISA"] = isa
            try:
                results[isa] = importlib.reload(K).KERNEL_ISA
            except (ValueError, RuntimeError) as exc:
                results[isa] = type(exc).__name__
        sys.modules["executor.kernels._kernels"] = None  # as if never built
        del K._kernels
        del os.environ["HELM_KERNEL_ISA"]
        try:
            importlib.reload(K)
            results["missing"] = "imported"
        except ImportError as exc:
            results["missing"] = "ImportError: " + str(exc)
        print(repr(results))
    """)
    env = dict(os.environ)
    env.pop("HELM_KERNEL_ISA", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = eval(proc.stdout.strip().splitlines()[-1])
    assert results["default"] == ISAS_HERE[0]
    for isa in K.ISAS:
        assert results[isa] == (isa if isa in ISAS_HERE else "RuntimeError"), results
    assert results["bogus"] == "ValueError"
    assert results["missing"].startswith("ImportError") and "pip install -e ." in results["missing"]


# -- sizes from a caller are checked without overflowing C integers (found by fuzzing: each of
# these wrote or read far outside its buffers) ----------------------------------------------------
def test_a_head_count_that_wraps_an_int_is_refused_not_overrun():
    qkv, cos, sin = torch.zeros(1, 4), torch.ones(1, 2), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="fewer than"):
        K.rope_qk_(qkv, 2**30, 1, cos, sin, num_threads=1)  # (2**30 + 1) x 4 wraps to 4 in an int


def test_a_start_position_that_wraps_a_long_is_refused_not_overrun():
    layout = K.PagedKV(1, 1, 4, 8, torch.float32)
    page = torch.zeros(1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="do not cover"):
        K.kv_write(torch.randn(2, 3 * 8), layout, torch.tensor([page.data_ptr()]), 0, 2**63 - 2, 1)


def _one_block_stack(blocks, H=64, I=128, D=16, Hq=4, Hkv=2, P=16):
    layout = K.PagedKV(1, Hkv, P, D, torch.float32)
    return K.BlockStack(K.default_set, blocks, layout, Hq, H, I, 1e-6, D ** -0.5, num_threads=1)


def _block(H=64, I=128, D=16, Hq=4, Hkv=2):
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return K.prepare_linear(torch.randn(*shape, generator=g) * 0.05)
    return (torch.ones(H), w((Hq + 2 * Hkv) * D, H), None, None, w(H, Hq * D), torch.ones(H), w(2 * I, H), w(H, I))


def test_a_block_stack_keeps_its_weights_whatever_the_caller_does_with_its_list():
    """The C descriptors point into the blocks' tensors: the stack holds them, not the caller's list
    (clearing that list freed them, and the next step read freed memory)."""
    import gc

    blocks = [_block()]
    stack = _one_block_stack(blocks)
    page = torch.zeros(1, 2, 2, 16, 16)
    table = torch.tensor([page.data_ptr()])
    cos, sin, x = torch.ones(1, 8), torch.zeros(1, 8), torch.randn(1, 64)
    before = stack(x.clone(), cos, sin, [(0, 1, 0, table)])
    blocks.clear()
    gc.collect()
    junk = [torch.full((64 * 128,), 1e30) for _ in range(16)]  # reuse what was freed
    assert torch.equal(stack(x.clone(), cos, sin, [(0, 1, 0, table)]), before)
    del junk


def test_a_block_stack_step_is_bounded_and_one_at_a_time():
    """Its per-sequence arrays live on the C stack (a step of 400,000 sequences overflowed it) and its
    tile claims are per instance (two threads on one stack silently mixed their results)."""
    import threading

    stack = _one_block_stack([_block()])
    rows = K.MAX_STACK_ROWS + 1
    with pytest.raises(ValueError, match="more than a BlockStack step takes"):
        stack(torch.zeros(rows, 64), torch.ones(rows, 8), torch.zeros(rows, 8), [(0, rows, 0, torch.zeros(1))])
    pages = torch.zeros(512, 2, 2, 16, 16)
    table = torch.tensor([pages[i].data_ptr() for i in range(512)])
    errors, started = [], threading.Event()

    def step(n, pages):
        try:
            stack(torch.randn(n, 64), torch.ones(n, 8), torch.zeros(n, 8), [(0, n, 0, pages)])
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=lambda: (started.set(), step(4096, table[:256])))
    t.start()
    started.wait(10)
    while t.is_alive():  # short steps beside the long one (it runs without the GIL): one of two is refused
        step(1, table[256:257])
    t.join(60)
    assert errors and all("already running a step" in str(e) for e in errors)


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_infinite_inputs_give_infinite_outputs(isa):
    """An infinite activation gives ±inf where the reference does (the avx512bf16 GEMV splits x
    into bf16 hi + lo parts, and inf - inf made the lo part NaN)."""
    ks = K.KernelSet(isa)
    gen = torch.Generator().manual_seed(9)
    for dtype in DTYPES:
        weight = (torch.rand(9, 70, generator=gen) + 0.5).to(dtype)  # no zero: inf · 0 is NaN
        x = torch.randn(2, 70, generator=gen)
        x[0, 3], x[1, 40] = float("inf"), float("-inf")
        y = ks.linear(x, K.prepare_linear(weight), num_threads=1)
        assert torch.equal(y, linear_ref(x, weight)), f"{isa} {dtype}"


def test_kernels_refuse_to_write_rows_that_overlap():
    """An expanded tensor's rows are one row in memory: rotated or written in place several times
    over (PyTorch refuses such in-place writes too)."""
    ks = K.KernelSet("portable")
    row = torch.randn(1, 2 * 3 * 8)
    cos, sin = torch.ones(4, 4), torch.zeros(4, 4)
    with pytest.raises(ValueError, match="rows overlap"):
        ks.rope_qk_(row.expand(4, -1), 2, 1, cos, sin, num_threads=1)
    gate = torch.randn(4, 8)
    with pytest.raises(ValueError, match="rows overlap"):
        ks.silu_mul(gate, gate, out=torch.empty(1, 8).expand(4, -1), num_threads=1)
