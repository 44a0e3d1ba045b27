"""The compute backend of a stage: its linear operator and element-wise ops.

"torch" is the reference path (plain PyTorch, any device); "helm" runs the CPU stage on our
Cython SIMD kernels (executor.kernels), with the same fp32-activation semantics. A stage is
given one backend object and never asks which it is, so the kernels plug in behind the same
stage code.
"""
from __future__ import annotations

import importlib
import logging

import torch

from executor import torch_ops
from executor.attention import TorchAttention, fused_prompt_attention
from executor.device_step import ResidentDecode
from executor.rope import inverse_frequencies, rotary_tables

log = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"

    def __init__(self, fused_prompt: bool = True):
        # False: a GPU stage's prompt chunks stream even where flash attention runs (its plan's
        # profile said it does not, and priced them so: planner/working_set.py)
        self.fused_prompt = fused_prompt

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, widen: bool = True):
        return torch_ops.TorchLinear(weight, bias, widen)

    def attention(self, config, kv):
        # A GPU stage (on CUDA, or its code on the CPU over a slab) takes the fused prompt path;
        # the CPU reference streams.
        gpu_stage = kv is not None and (kv.device.type == "cuda" or kv.device_pool.slab is not None)
        return TorchAttention(config, kv, self, fused_prompt=gpu_stage and self.fused_prompt)

    def fused_blocks(self, config, blocks, kv, attention) -> ResidentDecode | None:
        """The static-shape decode step (CUDA graphs on CUDA) where the device KV pool is a slab;
        otherwise None: op by op."""
        if kv is None or kv.device_pool.slab is None:
            return None
        return ResidentDecode(config, blocks, kv, attention, self)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return torch_ops.rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch_ops.silu_mul(gate, up, dtype)


class KernelLinear:
    """y = x @ W.T + b through executor.kernels (fp32 activations, fp32 accumulation)."""

    input_dtype = torch.float32

    def __init__(self, kernel_set, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int):
        from executor.kernels import prepare_linear

        self._linear = kernel_set.linear
        self.weight = weight
        self.bias = bias
        self.prepared = prepare_linear(weight, bias)
        self.num_threads = num_threads

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + b, or with `residual`: residual += x @ W.T + b in place (returned)."""
        if residual is None:
            return self._linear(x.contiguous(), self.prepared, num_threads=self.num_threads)
        return self._linear(x.contiguous(), self.prepared, residual, num_threads=self.num_threads, accumulate=True)


class KernelAttention:
    """The CPU stage's self-attention on the kernels: q/k RMSNorm and RoPE in place on the qkv
    projection, K/V stored straight into the sequence's pages, attention streamed over the pages
    in C (online softmax, GQA: each K/V read once for its query heads). A chunk of more than
    `max_queries` prompt tokens goes to PyTorch's fused CPU attention instead (a blocked-GEMM
    flash kernel, `prompt_attention`): the kernel's per-query loop reads every key once per query,
    so from some chunk size on the GEMM wins; where is measured on the machine that runs
    (executor/probe.py: the plan's profile, or the load)."""

    def __init__(self, config, kv, kernels, num_threads: int, max_queries: int):
        if max_queries < 1:
            raise ValueError(f"max_queries must be >= 1, got {max_queries}")
        self.config, self.kv, self.kernels, self.num_threads = config, kv, kernels, num_threads
        self.max_queries = max_queries
        self.layout = kernels.PagedKV(kv.num_layers, kv.num_kv_heads, kv.page_size, kv.head_dim, kv.dtype)
        self.scale = config.head_dim ** -0.5

    @staticmethod
    def tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables a step's layers share, as the kernels take them."""
        return rotary_tables(inv_freq, positions)

    def uses_kernel(self, count: int) -> bool:
        """Whether a sequence's `count` queries of a step go to the attention kernel."""
        return count <= self.max_queries

    def __call__(self, qkv: torch.Tensor, q_norm, k_norm, layer: int, batch, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qkv: [T, (H_q + 2·H_kv)·D] fp32 (modified in place) → attention output [T, H_q·D] fp32."""
        cfg, k = self.config, self.kernels
        k.rope_qk_(qkv, cfg.num_heads, cfg.num_kv_heads, cos, sin, q_norm, k_norm, cfg.rms_norm_eps,
                   num_threads=self.num_threads)
        out = torch.empty(qkv.shape[0], cfg.q_dim)
        for s in batch.slices:
            rows, dst = qkv[s.offset:s.offset + s.count], out[s.offset:s.offset + s.count]
            table = self.kv.page_table(s.seq_id)
            k.kv_write(rows, self.layout, table, layer, s.start, cfg.num_heads)
            if self.uses_kernel(s.count):
                k.paged_attention(rows, dst, self.layout, table, layer, s.start, cfg.num_heads, self.scale,
                                  num_threads=self.num_threads)
            else:
                dst.copy_(self.prompt_attention(rows[:, :cfg.q_dim], layer, s.seq_id, s.start))
        return out

    def prompt_attention(self, q: torch.Tensor, layer: int, seq_id, start: int) -> torch.Tensor:
        """Causal attention of a chunk of queries q [n, H_q·D] (fp32) at positions start.. over the
        sequence's cached keys: its pages gathered into one K and one V for
        `fused_prompt_attention`. Returns [n, H_q·D]."""
        k, v = self.kv.gathered(layer, seq_id, start + q.shape[0])  # [H_kv, L, D]
        return fused_prompt_attention(q, k, v, start, self.config.num_heads, self.scale)


class FusedBlocks:
    """Steps of few tokens through all of a CPU stage's blocks in one kernel call
    (executor.kernels.BlockStack): the op-by-op kernel path, bit for bit, without Python and
    parallel-region start-up between the ops (at batch 1 those cost more than the small ops'
    arithmetic). Taken for steps of up to `max_rows` tokens, where every projection stays in our
    GEMV (the backend's routes send larger ones to a GEMM), whose every sequence's queries go to
    the attention kernel (`attention.uses_kernel`: a longer prompt chunk needs PyTorch's)."""

    MAX_ROWS = 32  # beyond this many tokens a step is prefill-like: op by op

    def __init__(self, kernels, kernel_set, config, blocks, kv, num_threads: int, attention: KernelAttention):
        self.kv = kv
        self.attention = attention
        layout = kernels.PagedKV(kv.num_layers, kv.num_kv_heads, kv.page_size, kv.head_dim, kv.dtype)
        spec = [(b.input_norm, b.qkv.prepared, b.q_norm, b.k_norm, b.o.prepared, b.post_norm,
                 b.gate_up.prepared, b.down.prepared) for b in blocks]
        self.stack = kernels.BlockStack(kernel_set, spec, layout, config.num_heads, config.hidden_size,
                                        config.intermediate_size, config.rms_norm_eps, config.head_dim ** -0.5,
                                        num_threads=num_threads)
        self.inv_freq = inverse_frequencies(config.rope, config.head_dim)
        dtypes = {linear.dtype for b in spec for linear in (b[1], b[4], b[6], b[7])}
        self.max_rows = next((r - 1 for r in range(1, self.MAX_ROWS + 1)
                              if any(kernel_set.path(dt, r) != "gemv" for dt in dtypes)), self.MAX_ROWS)

    def accepts(self, batch) -> bool:
        return batch.num_tokens <= self.max_rows and \
            all(self.attention.uses_kernel(s.count) for s in batch.slices)

    def __call__(self, x: torch.Tensor, batch) -> torch.Tensor:
        seqs = [(s.offset, s.count, s.start, self.kv.page_table(s.seq_id)) for s in batch.slices]
        cos, sin = rotary_tables(self.inv_freq, batch.positions)
        return self.stack(x.contiguous(), cos, sin, seqs)


class KernelBackend:
    """CPU only. Threads: passed explicitly to every kernel (default: torch's thread count).
    routes: how prompt chunks' GEMMs run per weight dtype ({dtype: (path, min_rows)}; none: every
    batch in our GEMV); attention_max_queries: the longest chunk of a sequence's queries the
    attention kernel takes. Both measured on this machine (executor/probe.py)."""

    name = "helm"

    def __init__(self, num_threads: int | None = None, routes: dict | None = None,
                 attention_max_queries: int = 1):
        from executor import kernels

        self.kernels = kernels
        self.isa = kernels.KERNEL_ISA
        self.kernel_set = kernels.KernelSet(kernels.KERNEL_ISA, routes)
        self.num_threads = num_threads or torch.get_num_threads()
        self.attention_max_queries = attention_max_queries

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, widen: bool = True):
        """widen: ignored, the kernels write fp32."""
        return KernelLinear(self.kernel_set, weight, bias, self.num_threads)

    def attention(self, config, kv):
        return KernelAttention(config, kv, self.kernels, self.num_threads, self.attention_max_queries)

    def fused_blocks(self, config, blocks, kv, attention: KernelAttention) -> FusedBlocks:
        return FusedBlocks(self.kernels, self.kernel_set, config, blocks, kv, self.num_threads, attention)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, eps, num_threads=self.num_threads)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if dtype != torch.float32:
            raise ValueError(f"the CPU kernels' silu_mul writes fp32, not {dtype}")
        return self.kernels.silu_mul(gate, up, num_threads=self.num_threads)


def resolve_backend(backend: str = "auto") -> str:
    """"auto": our kernels when the compiled extension loads, else the PyTorch reference path."""
    if backend not in ("auto", "helm", "torch"):
        raise ValueError(f"kernel backend must be auto, helm or torch, got {backend!r}")
    if backend != "auto":
        return backend
    try:
        importlib.import_module("executor.kernels")  # does the compiled extension load?
    except ImportError as e:
        log.warning("CPU kernels unavailable, using PyTorch ops: %s", e)
        return "torch"
    return "helm"


def make_backend(name: str, device: torch.device, num_threads: int | None = None, routes: dict | None = None,
                 attention_max_queries: int = 1, *, fused_prompt: bool = True):
    """The backend object for a stage on `device` (CUDA stages always use PyTorch); num_threads:
    the kernels' threads (None: torch's current count); routes, attention_max_queries: see
    KernelBackend; fused_prompt: see TorchBackend."""
    if device.type != "cpu" or name == "torch":
        return TorchBackend(fused_prompt)
    if name == "helm":
        return KernelBackend(num_threads, routes, attention_max_queries)
    raise ValueError(f"unknown kernel backend {name!r}")
