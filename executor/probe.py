"""What the CPU stage's kernels achieve on this machine, measured on the shapes they run: the one
entry point through which `helm-plan profile` learns the rates its cost model prices and which
path each weight dtype's prompt GEMMs take — and through which the executor chooses those paths
itself when it runs without a plan.

Nothing in the executor is a threshold measured on another machine: a plan carries this
machine's choice (machine profile → `cpu.kernels`), and `gemm_routes` turns it into the
kernels' routes. Every figure is the best of a few timed repetitions (the least disturbed one),
since a shared machine's noise only ever slows a run down.

    rates = probe_cpu_kernels(["bfloat16"], threads=2, quick=True)
    routes = gemm_routes(rates["dtypes"])      # {torch.bfloat16: ("gemm", 16)}
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Rows of x in the probe's prompt GEMM: a prompt chunk's shape (the engine prefills in chunks of
#: up to 512 tokens; the packed GEMM's rate is flat from a few hundred rows on).
PROBE_ROWS = 256
#: The probe weight: a projection of a ~1-2B-parameter model (Qwen3-0.6B's MLP halves, Qwen3-1.7B's
#: o_proj), big enough that the weights stream from memory as in a real layer.
PROBE_N, PROBE_K = 2048, 2048
#: Batches at which the chosen path is raced against the GEMV tiles to find where it takes over.
CROSSOVER_ROWS = (12, 16, 24, 32, 48, 64, 96, 128, 192)
#: Prompt attention probe: Qwen3 heads (16 query, 8 KV, 128 wide), a 512-query chunk after 512
#: cached keys (the mask path the executor's chunked prefill takes after its first chunk).
ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_QUERIES, ATTN_PREFIX = 16, 8, 128, 512, 512

Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: page faults, packing buffers, PyTorch's first-call dispatch
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fma_peak_gflops(threads: int) -> float:
    """fp32 FMA peak of `threads` cores with this process's kernel ISA (registers only)."""
    from executor import kernels
    return kernels.kernels.fma_peak_gflops(threads)


def gemv_read_gibps(dtype: torch.dtype, threads: int, buffer_bytes: int, runs: int) -> list[float]:
    """GiB/s at which our GEMV (batch 1, the decode step's projections) streams cold weights of
    `dtype`: passes over 32 MiB matrices laid end to end in a buffer much larger than the caches."""
    from executor import kernels
    n = k = 4096
    per = n * k
    elem = torch.empty((), dtype=dtype).element_size()
    count = max(2, buffer_bytes // (per * elem))
    buf = torch.empty(count * per, dtype=dtype)
    buf.fill_(0.01)  # write every page: untouched pages map to the zero page and read from cache
    weights = [kernels.prepare_linear(buf[i * per:(i + 1) * per].view(n, k)) for i in range(count)]
    x, y = torch.randn(1, k), torch.empty(1, n)

    def one_pass() -> None:
        for w in weights:
            kernels.linear(x, w, y, num_threads=threads)

    one_pass()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        one_pass()
        out.append(count * per * elem / (time.perf_counter() - t0) / 2 ** 30)
    return out


def gemm_candidates(dtype: torch.dtype, threads: int, rows: int, reps: int, paths=None,
                    shape: tuple[int, int] = (PROBE_N, PROBE_K)) -> dict[str, float]:
    """GFLOP/s of every path `linear` can take for `rows` rows of x against a weight of `shape`
    (N, K): the probe weight, or a model's own."""
    from executor import kernels
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    w = kernels.prepare_linear((torch.randn(n, k, generator=gen) * 0.02).to(dtype))
    x = torch.randn(rows, k, generator=gen)
    out = torch.empty(rows, n)
    flops = 2.0 * rows * n * k
    rates = {}
    for path in paths or kernels.PROMPT_PATHS:
        if path == "torch_fp32" and dtype == torch.float32:
            continue  # the same call as "torch"
        if path == "gemv":
            ks = kernels.KernelSet(kernels.KERNEL_ISA)
        else:
            ks = kernels.KernelSet(kernels.KERNEL_ISA, routes={dtype: (path, kernels.MAX_TILE_B + 1)})
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)  # PyTorch's paths run on its own pool
        try:
            seconds = _best_seconds(lambda: ks.linear(x, w, out, num_threads=threads), reps)
        finally:
            torch.set_num_threads(previous)
        rates[path] = round(flops / seconds / 1e9, 1)
    return rates


def gemm_route(dtype: torch.dtype, threads: int, quick: bool = False,
               shape: tuple[int, int] = (PROBE_N, PROBE_K)) -> dict:
    """The fastest path for a prompt chunk of this weight dtype, the batch from which it beats the
    GEMV tiles (min_rows) and its rate: {path, min_rows, gflops, candidates}."""
    from executor import kernels
    reps = 2 if quick else 4
    candidates = gemm_candidates(dtype, threads, PROBE_ROWS, reps, shape=shape)
    path = max(candidates, key=candidates.get)
    min_rows = kernels.MAX_TILE_B + 1
    if path != "gemv":
        # From the largest batch down: the last batch at which the path still wins.
        min_rows = PROBE_ROWS
        for rows in sorted(CROSSOVER_ROWS, reverse=True):
            race = gemm_candidates(dtype, threads, rows, reps, ("gemv", path), shape)
            if race[path] < race["gemv"]:
                break
            min_rows = rows
    return {"path": path, "min_rows": min_rows, "gflops": candidates[path], "candidates": candidates}


def prompt_attention_gflops(dtype: torch.dtype, threads: int, reps: int) -> float:
    """GFLOP/s (4·D FLOPs per visible query-key pair and head) of the executor's prompt attention
    for a KV cache of `dtype` (executor.backends.fused_prompt_attention) on the probe chunk."""
    from executor.backends import fused_prompt_attention
    gen = torch.Generator().manual_seed(0)
    n, start, d = ATTN_QUERIES, ATTN_PREFIX, ATTN_HEAD_DIM
    q = torch.randn(n, ATTN_HEADS * d, generator=gen)
    k = torch.randn(ATTN_KV_HEADS, start + n, d, generator=gen).to(dtype)
    v = torch.randn(ATTN_KV_HEADS, start + n, d, generator=gen).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _best_seconds(lambda: fused_prompt_attention(q, k, v, start, ATTN_HEADS, d ** -0.5), reps)
    finally:
        torch.set_num_threads(previous)
    pairs = n * start + n * (n + 1) / 2
    return round(4.0 * d * ATTN_HEADS * pairs / seconds / 1e9, 1)


def probe_cpu_kernels(dtypes, threads: int, quick: bool = False, buffer_bytes: int = 1 << 30,
                      progress: Progress = _quiet) -> dict:
    """Every rate and choice of the CPU stage's kernels for the weight dtypes named (float32,
    bfloat16, float16), as plain data for the machine profile's `cpu.kernels`:
    {isa, threads, fma_peak_gflops, dtypes: [{dtype, gemv_gibps, gemm_path, gemm_min_rows,
    gemm_gflops, gemm_candidates, attention_gflops}]}."""
    from executor import kernels
    peak = round(fma_peak_gflops(threads), 1)
    progress(f"kernels {kernels.KERNEL_ISA}, {threads} threads: fp32 FMA peak {peak:.0f} GFLOP/s")
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        reads = gemv_read_gibps(dtype, threads, buffer_bytes, 3 if quick else 5)
        route = gemm_route(dtype, threads, quick)
        attention = prompt_attention_gflops(dtype, threads, 2 if quick else 3)
        others = ", ".join(f"{p} {r:.0f}" for p, r in route["candidates"].items() if p != route["path"])
        progress(f"{name}: decode GEMV {statistics.median(reads):.1f} GiB/s; prompt GEMM {route['path']} "
                 f"{route['gflops']:.0f} GFLOP/s from {route['min_rows']} rows ({others}); "
                 f"prompt attention {attention:.0f} GFLOP/s")
        rows.append({"dtype": name, "gemv_gibps": round(statistics.median(reads), 2), "gemm_path": route["path"],
                     "gemm_min_rows": route["min_rows"], "gemm_gflops": route["gflops"],
                     "gemm_candidates": route["candidates"], "attention_gflops": attention})
    return {"isa": kernels.KERNEL_ISA, "threads": threads, "fma_peak_gflops": peak, "dtypes": rows}


def gemm_routes(dtype_rows) -> dict:
    """KernelSet routes from probe rows (or the machine profile's `cpu.kernels.dtypes`, as dicts
    or objects with the same fields): {torch dtype: (path, min_rows)}."""
    routes = {}
    for row in dtype_rows:
        get = row.get if isinstance(row, dict) else (lambda f, r=row: getattr(r, f))
        if get("gemm_path") != "gemv":
            routes[DTYPES[get("dtype")]] = (get("gemm_path"), int(get("gemm_min_rows")))
    return routes


_measured_routes: dict[tuple, dict] = {}


def measured_routes(dtype: torch.dtype, threads: int, shape: tuple[int, int]) -> dict:
    """Routes for one weight dtype measured now (quick) on a model's own projection `shape` (N, K),
    once per process: what the executor uses when no plan says what this machine's profile
    measured."""
    from executor import kernels
    key = (dtype, threads, kernels.KERNEL_ISA, shape)
    if key not in _measured_routes:
        name = next(n for n, d in DTYPES.items() if d == dtype)
        route = gemm_route(dtype, threads, quick=True, shape=shape)
        _measured_routes[key] = gemm_routes([{"dtype": name, "gemm_path": route["path"],
                                             "gemm_min_rows": route["min_rows"]}])
    return _measured_routes[key]
