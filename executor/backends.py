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

from executor import ops
from executor.attention import TorchAttention, streaming_attention

log = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return ops.TorchLinear(weight, bias)

    def attention(self, config, kv):
        return TorchAttention(config, kv, self)

    def fused_blocks(self, config, blocks, kv) -> None:
        return None  # op by op

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops.rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(gate, up)

    @staticmethod
    def add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.add_(y)


class KernelLinear:
    """y = x @ W.T + b through executor.kernels (fp32 activations, fp32 accumulation)."""

    def __init__(self, kernels, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int):
        self._linear = kernels.linear
        self.weight = weight
        self.prepared = kernels.prepare_linear(weight, bias)
        self.num_threads = num_threads

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + b, or with `residual`: residual += x @ W.T + b in place (returned)."""
        if residual is None:
            return self._linear(x.contiguous(), self.prepared, num_threads=self.num_threads)
        return self._linear(x.contiguous(), self.prepared, residual, num_threads=self.num_threads, accumulate=True)


class KernelAttention:
    """The CPU stage's self-attention on the kernels: q/k RMSNorm and RoPE in place on the qkv
    projection, K/V stored straight into the sequence's pages, attention streamed over the pages
    in C (online softmax, GQA: each K/V read once for its query heads). A prefill chunk of more
    than KERNEL_MAX_QUERIES tokens that continues a cached prefix runs PyTorch's streaming
    attention over the same pages instead, where batched matmuls beat the kernel's per-query loop.

    Measured here (Qwen3-0.6B heads, bf16 KV, 2 threads; kernel vs PyTorch streaming attention):
    16 queries from position 0: 0.07 vs 0.22 ms; 32: 0.17 vs 0.30; 128: 1.9 vs 2.4; 512: 28.9 vs
    31.9; but 128 queries after 384 cached tokens: 12.1 vs 8.5 ms, 512 after 1536: 195 vs 132 ms."""

    KERNEL_MAX_QUERIES = 32

    @classmethod
    def uses_kernel(cls, start: int, count: int) -> bool:
        return count <= cls.KERNEL_MAX_QUERIES or start == 0

    def __init__(self, config, kv, kernels, num_threads: int):
        self.config, self.kv, self.kernels, self.num_threads = config, kv, kernels, num_threads
        self.layout = kernels.PagedKV(kv.num_layers, kv.num_kv_heads, kv.page_size, kv.head_dim, kv.dtype)
        self.scale = config.head_dim ** -0.5

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
            if self.uses_kernel(s.start, s.count):
                k.paged_attention(rows, dst, self.layout, table, layer, s.start, cfg.num_heads, self.scale,
                                  num_threads=self.num_threads)
            else:
                q = rows[:, :cfg.q_dim].reshape(s.count, cfg.num_heads, cfg.head_dim)
                chunks = self.kv.chunks(layer, s.seq_id, s.start + s.count)
                dst.copy_(streaming_attention(q, chunks, self.scale, positions[s.offset:s.offset + s.count])
                          .reshape(s.count, cfg.q_dim))
        return out


class FusedBlocks:
    """Steps of few tokens through all of a CPU stage's blocks in one kernel call
    (executor.kernels.BlockStack): the op-by-op kernel path, bit for bit, without Python and
    parallel-region start-up between the ops (at batch 1 those cost more than the small ops'
    arithmetic). Taken for decode and short chunks: up to `max_rows` tokens, where every projection
    stays in our GEMV (bf16 from 9 rows goes to oneDNN) and every sequence's queries go to the
    attention kernel."""

    def __init__(self, kernels, config, blocks, kv, num_threads: int):
        self.kv = kv
        layout = kernels.PagedKV(kv.num_layers, kv.num_kv_heads, kv.page_size, kv.head_dim, kv.dtype)
        spec = [(b.input_norm, b.qkv.prepared, b.q_norm, b.k_norm, b.o.prepared, b.post_norm,
                 b.gate_up.prepared, b.down.prepared) for b in blocks]
        self.stack = kernels.BlockStack(kernels.kernels, spec, layout, config.num_heads, config.hidden_size,
                                        config.intermediate_size, config.rms_norm_eps, config.head_dim ** -0.5,
                                        num_threads=num_threads)
        dtypes = {linear.dtype for b in spec for linear in (b[1], b[4], b[6], b[7])}
        limit = KernelAttention.KERNEL_MAX_QUERIES
        self.max_rows = next((r - 1 for r in range(1, limit + 1)
                              if any(kernels.kernels.uses_torch(dt, r) for dt in dtypes)), limit)

    def accepts(self, batch) -> bool:
        return batch.num_tokens <= self.max_rows

    def __call__(self, x: torch.Tensor, batch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        seqs = [(s.offset, s.count, s.start, self.kv.page_table(s.seq_id)) for s in batch.slices]
        return self.stack(x.contiguous(), cos, sin, seqs)


class KernelBackend:
    """CPU only. Threads: passed explicitly to every kernel (default: torch's thread count)."""

    name = "helm"

    def __init__(self, num_threads: int | None = None):
        from executor import kernels

        self.kernels = kernels
        self.isa = kernels.KERNEL_ISA
        self.num_threads = num_threads or torch.get_num_threads()

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return KernelLinear(self.kernels, weight, bias, self.num_threads)

    def attention(self, config, kv):
        return KernelAttention(config, kv, self.kernels, self.num_threads)

    def fused_blocks(self, config, blocks, kv) -> FusedBlocks:
        return FusedBlocks(self.kernels, config, blocks, kv, self.num_threads)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, eps, num_threads=self.num_threads)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate, up, num_threads=self.num_threads)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.kernels.add_(x, y.contiguous(), num_threads=self.num_threads)


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


def make_backend(name: str, device: torch.device, num_threads: int | None = None):
    """The backend object for a stage on `device` (CUDA stages always use PyTorch); num_threads:
    the kernels' threads (None: torch's current count)."""
    if device.type != "cpu" or name == "torch":
        return TorchBackend()
    if name == "helm":
        return KernelBackend(num_threads)
    raise ValueError(f"unknown kernel backend {name!r}")
