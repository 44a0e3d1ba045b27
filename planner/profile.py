"""`helm-plan profile`: measure this machine into a MachineProfile (DESIGN §4).

CPU: sustained DRAM read bandwidth measured the way decode reads weights — a GEMV over a
sequence of 64 MiB fp32 matrices laid end to end in a buffer far larger than L3, with all cores —
repeated, and every run kept so the spread is visible; L3 size from sysfs and its bandwidth
from the same GEMV over a buffer that fits in it; fp32 GEMM throughput; ISA flags; RAM; and the
executor's own kernels per weight dtype (executor/probe.py): the rates the cost model prices
decode and prompt chunks with, and the prompt-GEMM path the executor takes on this machine.
GPU (when CUDA is present): usable VRAM once the context exists, device-to-device copy
bandwidth, a prompt chunk's matmul throughput, the decode projection's weight reads, a decoder
block through the GPU stage's own decode step (executor/device_probe.py: its excess over the
block's roofline is the GPU's δ), pinned host↔device bandwidth and latency.

Every measuring function takes its device and synchronisation as arguments, so the GPU code runs
on CPU tensors in tests (same code path, device `cpu`).
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from planner.step_shape import PREFILL_CHUNK_TOKENS
from planner.machine import (L3_OVER_DRAM, MACHINE_SCHEMA_VERSION, Calibration, CpuKernels, CpuProfile,
                             DeviceCalibration, GpuProfile, LinkProfile, MachineProfile, l3_estimate, tool_version)
from planner.serial import from_dict
from planner.units import GIB, MIB, fmt_bytes, round_sig

# SIMD features our kernels (and torch) dispatch on; others in /proc/cpuinfo are not recorded.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")

Progress = Callable[[str], None]


def stderr_progress() -> Progress:
    start = time.perf_counter()

    def report(msg: str) -> None:
        print(f"[profile {time.perf_counter() - start:5.1f}s] {msg}", file=sys.stderr, flush=True)
    return report


def _quiet(msg: str) -> None:
    pass


# ---- facts (no measurement) ------------------------------------------------------------------

def _cpuinfo() -> list[dict[str, str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    procs, cur = [], {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                procs.append(cur)
            cur = {}
            continue
        k, _, v = line.partition(":")
        cur[k.strip()] = v.strip()
    if cur:
        procs.append(cur)
    return procs


def _l3_bytes() -> int:
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (idx / "level").read_text().strip() != "3":
                continue
            size = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best


def meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; (0, 0) where /proc/meminfo cannot be read."""
    total = avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, avail or total


def detect_cpu_facts() -> dict:
    """CPU model, usable cores/threads, ISA flags, L3 size, RAM — read, not measured."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        allowed = list(range(os.cpu_count() or 1))
    procs = _cpuinfo()
    by_id = {int(p["processor"]): p for p in procs if p.get("processor", "").isdigit()}
    cores = {(by_id[i].get("physical id", "0"), by_id[i].get("core id", str(i))) for i in allowed if i in by_id}
    flags = set()
    for p in procs[:1]:
        flags = set((p.get("flags") or p.get("Features") or "").split())
    total, avail = meminfo()
    return {
        "model_name": (procs[0].get("model name") if procs else None) or platform.processor() or "unknown",
        "cores": len(cores) or len(allowed),
        "threads": len(allowed),
        "isa": tuple(f for f in ISA_FLAGS if f in flags),
        "l3_bytes": _l3_bytes(),
        "ram_total_bytes": total,
        "ram_available_bytes": avail,
    }


# ---- CPU measurements ------------------------------------------------------------------------

def _gemv_pass_seconds(mats, x, y, min_seconds: float) -> tuple[float, int]:
    """Time full GEMV passes over `mats` until min_seconds elapsed: (seconds per pass, passes)."""
    import torch
    passes, start = 0, time.perf_counter()
    while True:
        for m in mats:
            torch.mv(m, x, out=y)
        passes += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / passes, passes


def _matrices(buffer_bytes: int, cols: int = 4096, rows: int = 4096):
    """fp32 weight matrices of rows×cols laid end to end in one written buffer."""
    import torch
    per = rows * cols
    count = max(1, buffer_bytes // (per * 4))
    buf = torch.empty(count * per, dtype=torch.float32)
    buf.fill_(1.0)  # write every page: untouched pages all map to the zero page and read from cache
    mats = [buf[i * per:(i + 1) * per].view(rows, cols) for i in range(count)]
    return buf, mats, torch.ones(cols), torch.empty(rows)


def measure_read_bandwidth(buffer_bytes: int, runs: int, min_seconds: float = 0.15,
                           progress: Progress = _quiet, label: str = "DRAM") -> tuple[float, list[float]]:
    """GiB/s of a GEMV over `buffer_bytes` of fp32 matrices: (median, every run)."""
    buf, mats, x, y = _matrices(buffer_bytes)
    nbytes = len(mats) * mats[0].numel() * 4
    _gemv_pass_seconds(mats, x, y, 0.0)  # warm-up pass
    results = []
    for r in range(runs):
        sec, _ = _gemv_pass_seconds(mats, x, y, min_seconds)
        results.append(round_sig(nbytes / sec / GIB, 4))
        progress(f"{label} read {fmt_bytes(nbytes)} run {r + 1}/{runs}: {results[-1]:.2f} GiB/s")
    del buf, mats
    return round_sig(statistics.median(results), 4), results


def measure_kv_read_gibps(buffer_bytes: int, runs: int, threads: int,
                          progress: Progress = _quiet) -> float | None:
    """GiB/s at which the executor's CPU attention kernel streams a cold bf16 KV cache
    (executor.probe.kv_read_gibps); None when the kernels are not built."""
    try:
        from executor.probe import kv_read_gibps  # the kernels are optional: built by pip install -e .
    except ImportError:
        progress("KV read: CPU kernels not built; η_kv left at 1")
        return None
    return kv_read_gibps(buffer_bytes, runs, threads, progress)


def measure_cpu_kernels(threads: int, quick: bool, buffer_bytes: int,
                        progress: Progress = _quiet) -> CpuKernels | None:
    """The executor's own CPU kernels on this machine, for every weight dtype (executor/probe.py):
    decode GEMV read rate, the fastest prompt-GEMM path with its rate and crossover, prompt
    attention's rate, and the FMA peak. None when the kernels are not built."""
    try:
        from executor.probe import probe_cpu_kernels
        measured = probe_cpu_kernels(("bfloat16", "float16", "float32"), threads, quick,
                                     min(buffer_bytes, GIB), progress)
    except ImportError as e:
        progress(f"CPU kernels not built ({e}); the cost model falls back to the DRAM and fp32 GEMM figures")
        return None
    return from_dict(CpuKernels, measured)


def measure_cpu_gflops(n: int = 1024, min_seconds: float = 0.3) -> float:
    """fp32 GEMM throughput (GFLOP/s) with the current torch thread count."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(3):
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_seconds / 3:
            torch.mm(a, b)
            reps += 1
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e9)
    return round_sig(best, 4)


# ---- GPU measurements ------------------------------------------------------------------------

def _timed(fn, sync, reps: int) -> float:
    """Seconds per call of fn(), synchronised before and after."""
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def _copy_gibps(device, nbytes: int, timer: Callable[[Callable[[], object], int], float], runs: int,
                progress: Progress) -> list[float]:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written, each run timed by
    `timer` over 10 copies (on CUDA its events: the HBM roofline of bench_gpu.py is this figure,
    and the host's clock would add a launch and a synchronisation to every run)."""
    import torch
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    out = []
    for r in range(runs):
        out.append(round_sig(2 * nbytes / timer(lambda: b.copy_(a), 10) / GIB, 4))
        progress(f"HBM device copy {fmt_bytes(nbytes)} run {r + 1}/{runs}: {out[-1]:.1f} GiB/s")
    return out


def _matmul_gflops(device, hidden: int, dtype, timer: Callable[[Callable[[], object], int], float],
                   reps: int) -> float:
    """(PREFILL_CHUNK_TOKENS, H) x (H, H) matmul in `dtype`: a prompt chunk through a projection,
    as the GPU stage multiplies it (in the checkpoint's half-precision dtype)."""
    import torch
    x = torch.randn(PREFILL_CHUNK_TOKENS, hidden, device=device).to(dtype)
    w = torch.randn(hidden, hidden, device=device).to(dtype)
    torch.mm(x, w)
    flops = 2 * PREFILL_CHUNK_TOKENS * hidden * hidden
    return max(flops / timer(lambda: torch.mm(x, w), reps) for _ in range(3)) / 1e9


def _cuda_event_timer(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call of fn() by CUDA events around the calls: the GPU's time, not the host's
    launch and synchronisation time (which a short kernel would be mostly made of)."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _link(device, nbytes: int, sync, pin_memory: bool, reps: int) -> tuple[float, float, float, float]:
    """(h2d GiB/s, d2h GiB/s, h2d latency us, d2h latency us) for host<->device copies."""
    import torch
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / _timed(lambda: dev.copy_(host, non_blocking=True), sync, reps) / GIB
    d2h = nbytes / _timed(lambda: host.copy_(dev, non_blocking=True), sync, reps) / GIB
    small_h = torch.ones(4, dtype=torch.uint8, pin_memory=pin_memory)
    small_d = torch.empty(4, dtype=torch.uint8, device=device)

    def one_copy(dst, src):
        def fn():
            dst.copy_(src, non_blocking=True)
            sync()
        return fn
    return (h2d, d2h, _timed(one_copy(small_d, small_h), sync, 50) * 1e6,
            _timed(one_copy(small_h, small_d), sync, 50) * 1e6)


def measure_gpu(device, *, name: str, mem_get_info: Callable[[], tuple[int, int]],
                sync: Callable[[], None], pin_memory: bool, quick: bool,
                copy_bytes: int | None = None, link_bytes: int | None = None, hidden: int = 4096,
                timer: Callable[[Callable[[], object], int], float] | None = None,
                release: Callable[[], None] = lambda: None, matmul_dtype=None,
                stream_workspace: Callable[[], int] | None = None,
                flash_attention: Callable[[], bool] | None = None, gemv: bool = True,
                decode_block: dict | None = None,
                progress: Progress = _quiet) -> tuple[GpuProfile, LinkProfile]:
    """Measure a torch device as the GPU stage's device, and the host link to it. timer: seconds
    per call of a kernel (default: host clock between synchronisations); release: return the
    probes' freed buffers to the device; matmul_dtype: the prefill matmul's (default bf16);
    stream_workspace: bytes a new stream's first GEMM keeps (None: not measured); flash_attention:
    whether PyTorch's flash attention runs the GPU stage's prompt chunks (None: not asked); gemv:
    time the GPU stage's decode projection (executor/device_probe.py, device_gemv_gibps);
    decode_block: a config.json's fields whose decoder block to time through the executor's
    decode step (device_probe.decode_block_ms; in matmul_dtype), beside its roofline at this
    device's rates (None: not timed). Usable VRAM is
    read after the probes, so what stays allocated once the GPU has run a matmul (cuBLAS's handle
    and workspace for one stream) counts as reserved."""
    import torch
    timer = timer or (lambda fn, reps: _timed(fn, sync, reps))
    matmul_dtype = matmul_dtype or torch.bfloat16
    free, total = mem_get_info()
    progress(f"GPU {name}: {fmt_bytes(total)} total, {fmt_bytes(free)} free with the context")
    # 1 GiB where an eighth of the free VRAM holds it, quick or not: far beyond any L2, and
    # milliseconds of copying per run at HBM rates
    copy_bytes = copy_bytes or min(GIB, max(free // 8, MIB))
    hbm = _copy_gibps(device, copy_bytes, timer, 3 if quick else 7, progress)
    flops = _matmul_gflops(device, hidden, matmul_dtype, timer, 10 if quick else 50)
    shape = f"({PREFILL_CHUNK_TOKENS},{hidden})x({hidden},{hidden}) {str(matmul_dtype).removeprefix('torch.')}"
    progress(f"prefill matmul {shape}: {flops:.0f} GFLOP/s")
    weight_gibps = None
    if gemv:
        from executor.device_probe import device_gemv_gibps
        weight_gibps = device_gemv_gibps(device, hidden, matmul_dtype, timer, 10 if quick else 50)
        progress(f"decode projection (1,{hidden})x({hidden},{3 * hidden}) {str(matmul_dtype).removeprefix('torch.')}: "
                 f"{weight_gibps:.1f} GiB/s of weights (a device copy: {statistics.median(hbm):.1f})")
    gpu = GpuProfile(
        name=name, vram_total_bytes=int(total), vram_usable_bytes=int(free),
        cuda_context_reserve_bytes=int(total - free), hbm_gibps=round_sig(statistics.median(hbm), 4),
        hbm_gibps_runs=tuple(hbm), prefill_gflops=round_sig(flops, 4), prefill_matmul=shape,
        gemv_gibps=round_sig(weight_gibps, 4) if weight_gibps is not None else None)
    if decode_block is not None:
        gpu = _time_decode_block(gpu, device, {**decode_block, "torch_dtype": str(matmul_dtype).removeprefix("torch.")},
                                 timer, 5 if quick else 20, release, progress)
    link_bytes = link_bytes or ((64 * MIB) if quick else (256 * MIB))
    h2d, d2h, lat_h2d, lat_d2h = _link(device, link_bytes, sync, pin_memory, 3 if quick else 10)
    progress(f"link {fmt_bytes(link_bytes)} pinned={pin_memory}: h2d {h2d:.1f} GiB/s, d2h {d2h:.1f} GiB/s, "
             f"latency {lat_h2d:.1f}/{lat_d2h:.1f} us")
    release()
    free, total = mem_get_info()
    progress(f"GPU {name}: {fmt_bytes(free)} free after the probes")
    # after the read: a second stream's workspace is the executor's to price, not the reserve's
    workspace = stream_workspace() if stream_workspace is not None else None
    if workspace is not None:
        progress(f"a second stream's first GEMM keeps {fmt_bytes(workspace)} (cuBLAS workspace)")
    flash = flash_attention() if flash_attention is not None else None
    if flash is not None:
        progress("flash attention: " + ("runs half-precision GQA" if flash else
                                        "does not run here (prompt chunks stream over their KV pages)"))
    gpu = replace(gpu, vram_usable_bytes=int(free), cuda_context_reserve_bytes=int(total - free),
                  stream_workspace_bytes=workspace, flash_attention=flash)
    link = LinkProfile(h2d_gibps=round_sig(h2d, 4), d2h_gibps=round_sig(d2h, 4),
                       h2d_latency_us=round_sig(lat_h2d, 4), d2h_latency_us=round_sig(lat_d2h, 4),
                       pinned=pin_memory)
    return gpu, link


def _time_decode_block(gpu: GpuProfile, device, config: dict, timer, reps: int, release: Callable[[], None],
                       progress: Progress) -> GpuProfile:
    """gpu with the decode-block probe's figures: what one block of `config` adds to the GPU
    stage's decode step, and that block's roofline at gpu's rates (the cost model's T_proj +
    T_attn for one token at the probe's context)."""
    from executor.device_probe import DECODE_BLOCK_CONTEXT, decode_block_ms
    from planner.cost import gpu_rates, unit_decode_ms
    from planner.trace import trace_model

    try:
        measured, how = decode_block_ms(device, timer, reps, config)
    except RuntimeError as e:  # out of memory on a GPU busy with others, a failed capture: no δ
        release()
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        progress(f"decode block: not measured ({type(e).__name__}: {reason}); the plans price no δ for the GPU")
        return gpu
    if measured <= 0:  # the deeper stage no slower: noise swamped the difference, nothing to price
        progress(f"decode block: not measured (a deeper stage ran {-measured * 1e3:.1f} us a block faster)")
        return gpu
    block = next(u for u in trace_model(config).units if u.kind == "block")
    roofline = sum(unit_decode_ms(block, gpu_rates(gpu, DeviceCalibration()), 1, DECODE_BLOCK_CONTEXT))
    what = (f"{config['architectures'][0]} block (hidden {config['hidden_size']}, MLP {config['intermediate_size']}, "
            f"{config['num_attention_heads']}/{config['num_key_value_heads']} heads of {config['head_dim']}) "
            f"{config['torch_dtype']}, one token at context {DECODE_BLOCK_CONTEXT}, {how}")
    progress(f"decode block: {measured * 1e3:.1f} us a block, roofline {roofline * 1e3:.1f} us ({what})")
    return replace(gpu, decode_block_ms=round_sig(measured, 4), decode_block_roofline_ms=round_sig(roofline, 4),
                   decode_block=what)


def profiled_gpu_delta_ms(gpu: GpuProfile | None) -> float | None:
    """δ for the GPU from its decode-block probe: what a block's step took beyond its roofline (0
    where it ran at or under it); None where the probe did not run."""
    if gpu is None or gpu.decode_block_ms is None or gpu.decode_block_roofline_ms is None:
        return None
    return round_sig(max(0.0, gpu.decode_block_ms - gpu.decode_block_roofline_ms), 3)


def cuda_stream_workspace_bytes(dtype) -> int:
    """Bytes the caching allocator holds after one small GEMM on a new stream, beyond its output:
    cuBLAS's workspace for that stream, which it keeps (the executor captures its decode graphs
    on a stream of their own)."""
    import torch
    a = torch.ones(64, 64, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(torch.cuda.Stream()):
        out = a @ a
    torch.cuda.synchronize()
    return max(0, torch.cuda.memory_allocated() - before - out.numel() * out.element_size())


def flash_attention_runs(device, dtype, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> bool:
    """Whether PyTorch's flash attention runs attention of `num_heads` query heads over
    `num_kv_heads` KV heads of `head_dim` in `dtype` on this CUDA device (its half-precision
    kernels, on a GPU and head size it has them for, not turned off): the one fused kernel that
    takes GQA and an offset causal chunk without a mask. The executor's GPU stage asks it for its
    model's shape (executor/attention.py); the profile for a Qwen3-8B / Llama-3-8B head layout.
    False off CUDA."""
    import torch
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    q = torch.empty(1, num_heads, 2, head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, num_kv_heads, 4, head_dim, device=device, dtype=dtype)
    params = torch.backends.cuda.SDPAParams(q, kv, kv, None, 0.0, False, num_heads != num_kv_heads)
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))


def probe_cuda(quick: bool, progress: Progress) -> tuple[GpuProfile, LinkProfile] | None:
    """Measure CUDA device 0 when torch sees one; None otherwise."""
    import torch
    if not torch.cuda.is_available():
        progress("no CUDA device: CPU-only profile")
        return None
    torch.cuda.init()
    torch.empty(1, device="cuda")  # create the context so mem_get_info sees its reserve
    # GPUs without bf16 tensor cores (before Ampere) run fp16 checkpoints' rate
    dtype = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16
    from executor.device_probe import DECODE_BLOCK_CONFIG
    return measure_gpu(torch.device("cuda"), name=torch.cuda.get_device_name(0),
                       mem_get_info=torch.cuda.mem_get_info, sync=torch.cuda.synchronize,
                       pin_memory=True, quick=quick, timer=_cuda_event_timer, release=torch.cuda.empty_cache,
                       matmul_dtype=dtype, stream_workspace=lambda: cuda_stream_workspace_bytes(dtype),
                       flash_attention=lambda: flash_attention_runs("cuda", dtype), decode_block=DECODE_BLOCK_CONFIG,
                       progress=progress)


# ---- the whole profile -----------------------------------------------------------------------

def _busy(threads: int) -> str | None:
    """Why the figures may be other work's leftovers: a load average above half the threads."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    if load <= 0.5 * threads:
        return None
    return (f"the machine is busy (load average {load:.2f} for {threads} threads): the figures are what other work "
            "leaves; profile an idle machine for a plan that holds")


def _disagreements(dram: float, dram_runs: list[float], kernels) -> list[str]:
    """Signs that other work ran during the probes: DRAM runs far apart, or the decode kernel
    reading far below the DRAM probe it normally matches."""
    found = []
    if min(dram_runs) * 2 < max(dram_runs):
        found.append(f"the DRAM runs disagree ({min(dram_runs):.1f}–{max(dram_runs):.1f} GiB/s): profile again "
                     "on an idle machine")
    for row in kernels.dtypes if kernels else ():
        if row.gemv_gibps < 0.5 * dram:
            found.append(f"the {row.dtype} decode GEMV read {row.gemv_gibps:.1f} GiB/s, under half the DRAM "
                         f"probe's {dram:.1f}: other work likely ran during it; profile again on an idle machine")
    return found


def profile_machine(quick: bool = False, name: str | None = None, progress: Progress | None = None,
                    threads: int | None = None,
                    gpu_probe: Callable[[bool, Progress], tuple[GpuProfile, LinkProfile] | None] | None = None,
                    ) -> MachineProfile:
    """Measure this machine. Full: ~10–40 s; quick: a few seconds (smaller buffer, fewer runs)."""
    progress = progress or _quiet
    progress("starting: loading torch")
    import torch

    gpu_probe = gpu_probe or probe_cuda
    started = time.perf_counter()
    facts = detect_cpu_facts()
    threads = threads or facts["cores"]
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _profile(quick, name, progress, threads, facts, gpu_probe, started)
    finally:
        torch.set_num_threads(previous_threads)  # measuring must not change the caller's torch


def _profile(quick, name, progress, threads, facts, gpu_probe, started) -> MachineProfile:
    l3 = facts["l3_bytes"]
    busy = _busy(threads)
    if busy:
        progress(f"warning: {busy}")
    progress(f"CPU {facts['model_name']}: {facts['cores']} cores, {facts['threads']} threads, "
             f"L3 {fmt_bytes(l3)}, RAM {fmt_bytes(facts['ram_total_bytes'])} "
             f"({fmt_bytes(facts['ram_available_bytes'])} available), ISA {' '.join(facts['isa']) or '-'}")
    # the DRAM buffer must dwarf the L3 (else we measure the cache) but leave RAM to others
    floor = GIB if quick else 2 * GIB
    buffer_bytes = min(max(floor, (3 if quick else 6) * l3), max(facts["ram_available_bytes"] // 4, 256 * MIB))
    progress(f"DRAM read bandwidth: GEMV over {fmt_bytes(buffer_bytes)} of 64 MiB fp32 matrices, "
             f"{threads} threads")
    dram, dram_runs = measure_read_bandwidth(buffer_bytes, 3 if quick else 7,
                                             0.1 if quick else 0.25, progress, "DRAM")
    if quick or l3 == 0:
        l3_gibps, l3_source = l3_estimate(dram), f"estimated: {L3_OVER_DRAM:g} x dram"
    else:
        l3_buf = max(MIB, min(l3 // 2, 256 * MIB))
        l3_gibps, _ = measure_read_bandwidth(l3_buf, 5, 0.1, progress, "L3")
        l3_source = "measured"
    gflops = measure_cpu_gflops(min_seconds=0.15 if quick else 0.6)
    progress(f"CPU fp32 GEMM: {gflops:.0f} GFLOP/s")
    kv_gibps = measure_kv_read_gibps(buffer_bytes, 3 if quick else 5, threads, progress)
    calibration = Calibration()
    if kv_gibps is not None:
        # The cost model reads KV at M̂·η_m·η_kv: the probe's cold-cache rate relative to DRAM's.
        calibration = Calibration(cpu=DeviceCalibration(eta_kv=round_sig(min(1.0, kv_gibps / dram), 3)),
                                  provenance="profiled")
    cpu_kernels = measure_cpu_kernels(threads, quick, buffer_bytes, progress)
    measured = gpu_probe(quick, progress)
    gpu, link = measured if measured else (None, None)
    delta = profiled_gpu_delta_ms(gpu)
    if delta is not None:
        # the first plans price the GPU stage's kernels beyond the roofline; recalibration refits δ
        calibration = replace(calibration, cuda=DeviceCalibration(delta_ms_per_block=delta), provenance="profiled")
    seconds = time.perf_counter() - started
    load = ""
    try:
        load = " Load average while measuring: %.2f (other work lowers the figures)." % os.getloadavg()[0]
    except OSError:
        pass
    cpu = CpuProfile(
        model_name=facts["model_name"], cores=facts["cores"], threads=facts["threads"], isa=facts["isa"],
        l3_bytes=l3, dram_read_gibps=dram, dram_read_gibps_runs=tuple(dram_runs),
        dram_buffer_bytes=buffer_bytes, l3_read_gibps=l3_gibps, l3_read_source=l3_source,
        compute_gflops=gflops, ram_total_bytes=facts["ram_total_bytes"],
        ram_available_bytes=facts["ram_available_bytes"], kernels=cpu_kernels)
    progress(f"done in {seconds:.1f}s: DRAM {dram:.2f} GiB/s (runs {min(dram_runs):.2f}–{max(dram_runs):.2f})")
    for warning in _disagreements(dram, dram_runs, cpu_kernels):
        progress(f"warning: {warning}")
    return MachineProfile(
        kind="machine_profile", schema_version=MACHINE_SCHEMA_VERSION,
        name=name or platform.node() or "this-machine", source="measured",
        notes=f"measured by helm-plan profile{' --quick' if quick else ''} with {threads} threads.{load}",
        tool_version=tool_version(), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        profile_seconds=round_sig(seconds, 3), quick=quick, cpu=cpu, gpu=gpu, link=link,
        calibration=calibration)


def placeholder_machine(cores: int | None = None) -> MachineProfile:
    """A machine that was not measured: this host's CPU facts (no benchmarks) plus nominal
    bandwidths and a nominal 24 GiB GPU. Lets a plan be made for a forced split (tests, the
    executor's --split) without profiling; its predictions mean nothing."""
    facts = detect_cpu_facts()
    cpu = CpuProfile(
        model_name=facts["model_name"], cores=cores or facts["cores"], threads=max(facts["threads"], cores or 0),
        isa=facts["isa"], l3_bytes=facts["l3_bytes"], dram_read_gibps=20.0, dram_read_gibps_runs=(),
        dram_buffer_bytes=0, l3_read_gibps=60.0, l3_read_source="manual", compute_gflops=100.0,
        ram_total_bytes=facts["ram_total_bytes"], ram_available_bytes=facts["ram_available_bytes"])
    gpu = GpuProfile(name="unprofiled GPU (nominal)", vram_total_bytes=24 << 30, vram_usable_bytes=23 << 30,
                     cuda_context_reserve_bytes=1 << 30, hbm_gibps=800.0, hbm_gibps_runs=(),
                     prefill_gflops=50000.0, prefill_matmul="nominal")
    link = LinkProfile(h2d_gibps=12.0, d2h_gibps=12.0, h2d_latency_us=10.0, d2h_latency_us=10.0, pinned=True)
    return MachineProfile(
        kind="machine_profile", schema_version=MACHINE_SCHEMA_VERSION, name="placeholder",
        source="placeholder", notes="not measured: nominal numbers, predictions are not meaningful",
        tool_version=tool_version(), measured_at=None, profile_seconds=None, quick=False,
        cpu=cpu, gpu=gpu, link=link, calibration=Calibration())
