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
    routes, max_queries = measured_choice(model_config, threads=2)   # without a plan
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch

from planner.units import GIB, fmt_bytes, round_sig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Rows of x in the probe's prompt GEMM: a prompt chunk's shape (the engine prefills in chunks of
#: up to 512 tokens; the packed GEMM's rate is flat from a few hundred rows on).
PROBE_ROWS = 256
#: The probe weight: a projection of a ~1-2B-parameter model (Qwen3-0.6B's MLP halves, Qwen3-1.7B's
#: o_proj), big enough that the weights stream from memory as in a real layer.
PROBE_N, PROBE_K = 2048, 2048
#: Batches at which the chosen path is raced against the GEMV tiles to find where it takes over.
CROSSOVER_ROWS = (12, 16, 24, 32, 48, 64, 96, 128, 192)
#: The prompt-block probe: a decoder block of Qwen3-0.6B's dimensions (hidden 1024, MLP 3072, 16
#: query and 8 KV heads of 128) run as the executor runs a prompt chunk through it — RMSNorm,
#: q/k/v projection, q/k norm + RoPE, o projection added to the residual, RMSNorm, gate/up
#: projection, SiLU·mul, down projection added to the residual — over several layers' weights
#: (more than the caches hold), at a short and a full chunk. Its rate per projection FLOP is what
#: the cost model prices a prompt chunk's projections with: the element-wise work is in it.
BLOCK_HIDDEN, BLOCK_MLP, ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM = 1024, 3072, 16, 8, 128
BLOCK_LAYERS = 6
BLOCK_ROWS = (128, 512)
#: Prompt attention probe: those heads, a 1024-token prompt in the executor's two chunks of 512 (the
#: first causal from position 0, the second after 512 cached keys, through the mask path).
ATTN_CHUNK, ATTN_CHUNKS = 512, 2
#: Chunk sizes at which our attention kernel is raced against the fused attention, after
#: ATTN_CROSSOVER_PREFIX cached keys in pages of ATTN_CROSSOVER_PAGE tokens.
CROSSOVER_QUERIES = (2, 4, 8, 16, 32, 64)
ATTN_CROSSOVER_PREFIX, ATTN_CROSSOVER_PAGE = 1024, 256

Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


@contextlib.contextmanager
def _torch_threads(threads: int):
    """PyTorch's pool at `threads` (its paths run there, the kernels take theirs as an argument),
    restored afterwards: measuring must not change the caller's torch."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    return _best_seconds_each({"fn": fn}, reps)["fn"]


def _best_seconds_each(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """The best of `reps` timed calls of each function, taken in turns (one call of each per
    round), so that a burst of another process's work slows one round of every candidate rather
    than every run of one of them: a race decided by one candidate's bad luck picks a path that
    can be twice as slow for as long as the process runs."""
    for fn in fns.values():
        fn()  # warm-up: page faults, packing buffers, PyTorch's first-call dispatch
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def fma_peak_gflops(threads: int) -> float:
    """fp32 FMA peak of `threads` cores with this process's kernel ISA (registers only)."""
    from executor import kernels
    return kernels.default_set.fma_peak_gflops(threads)


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


def candidate_paths(dtype: torch.dtype) -> tuple[str, ...]:
    """The paths worth timing for a weight dtype: not "torch_fp32" for fp32 weights (it is the
    "torch" call), not "torch" for fp16 ones (oneDNN's fp16 GEMM rounds the result to fp16, which
    overflows past 65504: a prompt's activations can get there)."""
    from executor import kernels
    skip = {torch.float32: "torch_fp32", torch.float16: "torch"}.get(dtype)
    return tuple(p for p in kernels.PROMPT_PATHS if p != skip)


def gemm_candidates(dtype: torch.dtype, threads: int, rows: int, reps: int, paths=None,
                    shape: tuple[int, int] = (PROBE_N, PROBE_K)) -> dict[str, float]:
    """GFLOP/s of every path `linear` can take for `rows` rows of x against a weight of `shape`
    (N, K): the probe weight, or a model's own."""
    from executor import kernels
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    w = kernels.prepare_linear(torch.empty(n, k, dtype=dtype).uniform_(-0.03, 0.03, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    out = torch.empty(rows, n)
    flops = 2.0 * rows * n * k
    calls = {}
    for path in paths or candidate_paths(dtype):
        ks = kernels.KernelSet(kernels.KERNEL_ISA, routes=None if path == "gemv" else
                               {dtype: (path, kernels.MAX_TILE_B + 1)})
        calls[path] = lambda ks=ks: ks.linear(x, w, out, num_threads=threads)
    with _torch_threads(threads):
        seconds = _best_seconds_each(calls, reps)
    return {path: round(flops / s / 1e9, 1) for path, s in seconds.items()}


def gemm_route(dtype: torch.dtype, threads: int, quick: bool = False,
               shape: tuple[int, int] = (PROBE_N, PROBE_K)) -> dict:
    """The fastest path for a prompt chunk of this weight dtype, the batch from which it beats the
    GEMV tiles (min_rows) and its rate: {path, min_rows, gflops, candidates}."""
    from executor import kernels
    reps = 2 if quick else 3
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


def prompt_block_gflops(dtype: torch.dtype, threads: int, routes: dict, rows: int, reps: int,
                        layers: int = BLOCK_LAYERS) -> float:
    """Projection GFLOP/s of the prompt-block probe (see BLOCK_*) at `rows` tokens, the executor's
    kernels taking `routes`: projection FLOPs / the time of everything but attention."""
    from executor import kernels
    h, i, d = BLOCK_HIDDEN, BLOCK_MLP, ATTN_HEAD_DIM
    q, kv = ATTN_HEADS * d, ATTN_KV_HEADS * d
    ks = kernels.KernelSet(kernels.KERNEL_ISA, routes)
    gen = torch.Generator().manual_seed(0)

    def weight(n, k):
        return kernels.prepare_linear(torch.empty(n, k).uniform_(-0.03, 0.03, generator=gen).to(dtype))

    blocks = [(weight(q + 2 * kv, h), weight(h, q), weight(2 * i, h), weight(h, i)) for _ in range(layers)]
    norm, head_norm = torch.ones(h), torch.ones(d)
    x = torch.randn(rows, h, generator=gen)
    cos, sin = torch.randn(rows, d // 2, generator=gen), torch.randn(rows, d // 2, generator=gen)

    def chunk() -> None:
        for qkv_w, o_w, gate_up_w, down_w in blocks:
            qkv = ks.linear(kernels.rms_norm(x, norm, 1e-6, num_threads=threads), qkv_w, num_threads=threads)
            kernels.rope_qk_(qkv, ATTN_HEADS, ATTN_KV_HEADS, cos, sin, head_norm, head_norm, 1e-6,
                             num_threads=threads)
            ks.linear(qkv[:, :q].contiguous(), o_w, x, num_threads=threads, accumulate=True)
            gate_up = ks.linear(kernels.rms_norm(x, norm, 1e-6, num_threads=threads), gate_up_w, num_threads=threads)
            act = kernels.silu_mul(gate_up[:, :i], gate_up[:, i:], num_threads=threads)
            ks.linear(act, down_w, x, num_threads=threads, accumulate=True)
            x.mul_(0.5)  # keep the residual stream bounded across repetitions

    with _torch_threads(threads):
        seconds = _best_seconds(chunk, reps)
    flops = 2.0 * rows * layers * (h * (q + 2 * kv) + q * h + 2 * i * h + i * h)
    return round(flops / seconds / 1e9, 1)


def prompt_attention_gflops(dtype: torch.dtype, threads: int, reps: int) -> float:
    """GFLOP/s (4·D FLOPs per visible query-key pair and head) of the executor's prompt attention
    for a KV cache of `dtype` (executor.attention.fused_prompt_attention) over the probe prompt's
    chunks."""
    from executor.attention import fused_prompt_attention
    gen = torch.Generator().manual_seed(0)
    n, d, total = ATTN_CHUNK, ATTN_HEAD_DIM, ATTN_CHUNK * ATTN_CHUNKS
    q = torch.randn(n, ATTN_HEADS * d, generator=gen)
    k = torch.randn(ATTN_KV_HEADS, total, d, generator=gen).to(dtype)
    v = torch.randn(ATTN_KV_HEADS, total, d, generator=gen).to(dtype)

    def prompt() -> None:
        for start in range(0, total, n):
            fused_prompt_attention(q, k[:, :start + n], v[:, :start + n], start, ATTN_HEADS, d ** -0.5)

    with _torch_threads(threads):
        seconds = _best_seconds(prompt, reps)
    pairs = total * (total + 1) / 2
    return round(4.0 * d * ATTN_HEADS * pairs / seconds / 1e9, 1)


def attention_kernel_max_queries(dtype: torch.dtype, threads: int, reps: int,
                                 heads: tuple[int, int, int] = (ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM)) -> int:
    """The longest chunk of queries (of CROSSOVER_QUERIES, at least 1) for which our paged
    attention kernel is at least as fast as the fused attention of the prompt path, the page
    gather included, over a KV cache of `dtype` with `heads` (query heads, KV heads, head dim)."""
    from executor import kernels
    from executor.attention import fused_prompt_attention
    hq, hkv, d = heads
    page, prefix = ATTN_CROSSOVER_PAGE, ATTN_CROSSOVER_PREFIX
    pages = -(-(prefix + max(CROSSOVER_QUERIES)) // page)
    gen = torch.Generator().manual_seed(0)
    buf = torch.empty(pages, 2, hkv, page, d, dtype=dtype).uniform_(-1.0, 1.0, generator=gen)
    table = torch.tensor([buf[i].data_ptr() for i in range(pages)], dtype=torch.int64)
    layout = kernels.PagedKV(1, hkv, page, d, dtype)
    scale = d ** -0.5
    longest = 1
    with _torch_threads(threads):
        for n in CROSSOVER_QUERIES:
            qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
            out = torch.empty(n, hq * d)
            q, keys = qkv[:, :hq * d], prefix + n
            used = -(-keys // page)

            def fused() -> None:
                k = torch.cat([buf[i, 0] for i in range(used)], 1)[:, :keys]
                v = torch.cat([buf[i, 1] for i in range(used)], 1)[:, :keys]
                fused_prompt_attention(q, k, v, prefix, hq, scale)

            def ours() -> None:
                kernels.paged_attention(qkv, out, layout, table, 0, prefix, hq, scale, num_threads=threads)

            race = _best_seconds_each({"ours": ours, "fused": fused}, reps)
            if race["ours"] > race["fused"]:
                break
            longest = n
    return longest


def probe_cpu_kernels(dtypes, threads: int, quick: bool = False, buffer_bytes: int = 1 << 30,
                      progress: Progress = _quiet) -> dict:
    """Every rate and choice of the CPU stage's kernels for the weight dtypes named (float32,
    bfloat16, float16), as plain data for the machine profile's `cpu.kernels`:
    {isa, threads, fma_peak_gflops, dtypes: [{dtype, gemv_gibps, gemm_path, gemm_min_rows,
    gemm_gflops, gemm_candidates, prompt_gflops, attention_gflops, attention_kernel_max_queries}]}."""
    from executor import kernels
    peak = round(fma_peak_gflops(threads), 1)
    progress(f"kernels {kernels.KERNEL_ISA}, {threads} threads: fp32 FMA peak {peak:.0f} GFLOP/s")
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        reads = gemv_read_gibps(dtype, threads, buffer_bytes, 3 if quick else 5)
        route = gemm_route(dtype, threads, quick)
        routes = _routes(name, route)
        block = [{"rows": r, "gflops": prompt_block_gflops(dtype, threads, routes, r, 1 if quick else 3,
                                                           BLOCK_LAYERS // 3 if quick else BLOCK_LAYERS)}
                 for r in BLOCK_ROWS]
        attention = prompt_attention_gflops(dtype, threads, 2 if quick else 3)
        max_queries = attention_kernel_max_queries(dtype, threads, 2 if quick else 3)
        others = ", ".join(f"{p} {r:.0f}" for p, r in route["candidates"].items() if p != route["path"])
        progress(f"{name}: decode GEMV {statistics.median(reads):.1f} GiB/s; prompt GEMM {route['path']} "
                 f"{route['gflops']:.0f} GFLOP/s from {route['min_rows']} rows ({others}); prompt block "
                 + ", ".join(f"{b['gflops']:.0f} at {b['rows']} rows" for b in block)
                 + f"; prompt attention {attention:.0f} GFLOP/s, our kernel up to {max_queries} queries")
        rows.append({"dtype": name, "gemv_gibps": round(statistics.median(reads), 2), "gemm_path": route["path"],
                     "gemm_min_rows": route["min_rows"], "gemm_gflops": route["gflops"],
                     "gemm_candidates": route["candidates"], "prompt_gflops": block,
                     "attention_gflops": attention, "attention_kernel_max_queries": max_queries})
    return {"isa": kernels.KERNEL_ISA, "threads": threads, "fma_peak_gflops": peak, "dtypes": rows}


def _routes(dtype_name: str, route: dict) -> dict:
    """KernelSet routes for one gemm_route result."""
    return gemm_routes([{"dtype": dtype_name, "gemm_path": route["path"], "gemm_min_rows": route["min_rows"]}])


def gemm_routes(dtype_rows) -> dict:
    """KernelSet routes from probe rows (or the machine profile's `cpu.kernels.dtypes`, as dicts
    or objects with the same fields): {torch dtype: (path, min_rows)}."""
    routes = {}
    for row in dtype_rows:
        get = row.get if isinstance(row, dict) else (lambda f, r=row: getattr(r, f))
        if get("gemm_path") != "gemv":
            routes[DTYPES[get("dtype")]] = (get("gemm_path"), int(get("gemm_min_rows")))
    return routes


#: The load-time probe times a model's largest projection, cut to at most this many rows and
#: columns: a 7B model's gate/up weight would cost seconds and hundreds of MB to race.
LOAD_PROBE_MAX = 4096

_measured: dict[tuple, tuple[dict, int]] = {}


def measured_choice(config, threads: int) -> tuple[dict, int]:
    """(routes, attention kernel's longest query chunk) for a model (an executor ModelConfig)
    measured now, quickly, on its own shapes — its gate/up projection (cut to LOAD_PROBE_MAX) and
    its heads — once per process: what the executor uses when no plan says what this machine's
    profile measured."""
    from executor import kernels
    dtype = config.dtype
    shape = (min(2 * config.intermediate_size, LOAD_PROBE_MAX), min(config.hidden_size, LOAD_PROBE_MAX))
    heads = (config.num_heads, config.num_kv_heads, config.head_dim)
    key = (dtype, threads, kernels.KERNEL_ISA, shape, heads)
    if key not in _measured:
        name = next(n for n, d in DTYPES.items() if d == dtype)
        route = gemm_route(dtype, threads, quick=True, shape=shape)
        routes = _routes(name, route)
        _measured[key] = routes, attention_kernel_max_queries(dtype, threads, 2, heads)
    return _measured[key]


def kv_read_gibps(buffer_bytes: int, runs: int, threads: int, progress: Progress = _quiet) -> float:
    """GiB/s at which the executor's CPU attention kernel streams a cold bf16 KV cache: one decode
    query at context 4096 per layer, as many layers as fill buffer_bytes (Qwen3-like heads: 16
    query, 8 KV, 128 wide; 512-token pages), median of `runs` passes over all layers.

    Why a probe of our own kernel, not only of the memory: attention reads KV in short runs per
    head and page, and computes a softmax as it goes, so it streams KV slower than the GEMV
    streams weights; the ratio of the two becomes the plans' default η_kv."""
    from executor import kernels
    hq, hkv, d, p, pages = 16, 8, 128, 512, 8  # context 8 x 512 = 4096
    layers = max(1, buffer_bytes // (pages * 2 * hkv * p * d * 2))
    page_elems = layers * 2 * hkv * p * d
    buf = torch.empty(pages * page_elems, dtype=torch.bfloat16)
    buf.fill_(0.01)  # write every page (untouched pages would read the zero page from cache)
    base = buf.data_ptr()
    table = torch.tensor([base + i * page_elems * 2 for i in range(pages)], dtype=torch.int64)
    layout = kernels.PagedKV(layers, hkv, p, d, torch.bfloat16)
    qkv = torch.randn(1, (hq + 2 * hkv) * d)
    out = torch.empty(1, hq * d)
    context = pages * p

    def one_pass() -> float:
        t0 = time.perf_counter()
        for layer in range(layers):
            kernels.paged_attention(qkv, out, layout, table, layer, context - 1, hq, d ** -0.5, num_threads=threads)
        return time.perf_counter() - t0

    one_pass()  # warm-up
    results = []
    for r in range(runs):
        results.append(buf.numel() * 2 / one_pass() / GIB)
        progress(f"KV read (attention kernel) {fmt_bytes(buf.numel() * 2)} run {r + 1}/{runs}: {results[-1]:.2f} GiB/s")
    del buf
    return round_sig(statistics.median(results), 4)
