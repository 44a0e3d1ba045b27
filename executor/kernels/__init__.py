"""CPU kernels of the executor's CPU stage: GEMV / small-batch GEMM over bf16, fp16 and fp32
weights at the DRAM-bandwidth ceiling, and the fused element-wise ops of a decoder block.

One build carries every variant (dtype × instruction set, see csrc/); the best one this CPU can
run is chosen once, here, at import, and reported as KERNEL_ISA. HELM_KERNEL_ISA=avx512bf16|
avx512|avx2|portable forces one (tests, benchmarks); forcing one the CPU cannot run is an error.
Activations are fp32 and every kernel accumulates in fp32. Threads are always passed in
(`num_threads`); the extension shares PyTorch's OpenMP runtime, so the two never oversubscribe
the cores as long as they are called one after the other.

Batches above MAX_TILE_B (prompt chunks) take a route per weight dtype (PROMPT_PATHS: our GEMV
tiles, our packed GEMM, or PyTorch's GEMM on the stored or widened weights), chosen by
measurement on the machine that runs (executor/probe.py) and given to KernelSet(isa,
routes); the default set `default_set` keeps every batch in our GEMV.

Importing this package without the compiled extension raises ImportError (the executor then
falls back to its PyTorch path, `--kernels torch`). The fp32 reference twins of every kernel are
in executor/kernels/reference.py.

    w = prepare_linear(weight, bias)          # once, at load time
    y = linear(x, w, num_threads=n)           # x: [B, K] fp32 → y: [B, N] fp32
"""
from __future__ import annotations

import os

# Load torch (and with it the libgomp.so.1 its wheel bundles) before the extension: the dynamic
# loader then binds the extension's libgomp.so.1 to that same copy, so there is one OpenMP
# runtime and one thread pool in the process, not two competing for the cores.
import torch  # noqa: F401

try:
    from executor.kernels import _kernels
except ImportError as exc:  # not built, or built for another Python
    raise ImportError(
        "executor.kernels: the compiled extension (executor/kernels/_kernels*.so) is not built "
        "or does not load; build it with `pip install -e .` (needs a C compiler with OpenMP), "
        "or run the executor with `--kernels torch`. Cause: " + str(exc)
    ) from exc

KernelSet = _kernels.KernelSet
PreparedLinear = _kernels.PreparedLinear
PagedKV = _kernels.PagedKV
BlockStack = _kernels.BlockStack  # (kernels, blocks, kv, Hq, H, I, eps, scale, *, num_threads)
MAX_STACK_ROWS = _kernels.MAX_STACK_ROWS
prepare_linear = _kernels.prepare_linear

#: Every variant compiled into the extension, in order of preference: the first one this CPU can
#: run is the default. avx512 ranks above avx512bf16 for bf16: at B=1 both stream at the DRAM
#: ceiling, while at B>=2 (or from cache) VDPBF16PS needs two instructions per weight vector for
#: fp32-level accuracy (x split into bf16 hi + lo) and issues at half the FMA rate
#: (tools/bench_kernels.py prints both side by side).
ISAS = ("avx512", "avx512bf16", "avx2", "portable")

#: Rows of x up to which `linear` makes a single pass over the weights (the GEMV register tiles).
MAX_TILE_B = _kernels.MAX_TILE_B

#: How `linear` may multiply more than MAX_TILE_B rows (see _kernels.pyx).
PROMPT_PATHS = _kernels.PROMPT_PATHS


def available_isas() -> list[str]:
    """The variants this CPU (and OS) can run, preferred first; "portable" is always there."""
    return [isa for isa in ISAS if _kernels.cpu_supports(isa)]


def _choose_isa() -> str:
    forced = os.environ.get("HELM_KERNEL_ISA", "").strip().lower()
    available = available_isas()
    if not forced:
        return available[0]
    if forced not in ISAS:
        raise ValueError(f"HELM_KERNEL_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    if forced not in available:
        raise RuntimeError(f"HELM_KERNEL_ISA={forced!r}: this CPU can run only {', '.join(available)}")
    return forced


#: The instruction set of the kernels in use; report it with every measurement.
KERNEL_ISA: str = _choose_isa()

#: The kernels of KERNEL_ISA; the module-level functions below are its bound methods.
default_set = KernelSet(KERNEL_ISA)

linear = default_set.linear  # (x [B, K] fp32, w: PreparedLinear, out=None, *, num_threads) → [B, N] fp32
rms_norm = default_set.rms_norm  # (x [..., H] fp32, weight [H], eps, out=None, *, num_threads)
silu_mul = default_set.silu_mul  # (gate, up, out=None, *, num_threads=1) → silu(gate) * up
rope_qk_ = default_set.rope_qk_  # (qkv, Hq, Hkv, cos, sin, q_norm=None, k_norm=None, eps, *, num_threads)
kv_write = default_set.kv_write  # (qkv, kv: PagedKV, pages, layer, start, Hq): K/V of qkv rows → pages
paged_attention = default_set.paged_attention  # (qkv, out, kv, pages, layer, start, Hq, scale, *, num_threads)

__all__ = [
    "ISAS", "KERNEL_ISA", "MAX_STACK_ROWS", "MAX_TILE_B", "PROMPT_PATHS", "BlockStack", "KernelSet", "PagedKV", "PreparedLinear",
    "available_isas", "default_set", "kv_write", "linear", "paged_attention", "prepare_linear", "rms_norm",
    "rope_qk_", "silu_mul",
]
