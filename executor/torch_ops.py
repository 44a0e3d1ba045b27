"""Reference tensor ops of a decoder block, in plain PyTorch.

Activations and accumulation stay in fp32 (on CUDA a product may stay in its half precision
until the op that consumes it widens it: TorchLinear); weights may be bf16/fp16/fp32. These are
the reference twins of the Cython kernels and the path used on CUDA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows of a half-precision weight upcast per matmul on the CPU: ~4 MiB of fp32 at a time stays in
# cache, so the reference path never materialises a full fp32 copy of a large matrix.
_UPCAST_CHUNK_ELEMS = 1 << 20


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., H] fp32, weight: [H] fp32 (None: not scaled; the caller scales) → [..., H] fp32.
    Off the CPU PyTorch's fused kernel: one launch where the steps below take six (and a copy
    before it for a strided x), in a decode step bound by launches (executor/device_step.py). On
    the CPU as transformers computes it."""
    if x.device.type != "cpu" and (weight is None or weight.dtype == x.dtype):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    variance = x.pow(2).mean(-1, keepdim=True)
    normed = x * torch.rsqrt(variance + eps)
    return normed if weight is None else weight * normed


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """silu(gate)·up computed in fp32, written in `dtype` (the next projection's input: the cast
    is the product's own, not an op of its own)."""
    out = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    return torch.mul(F.silu(gate), up, out=out)


def decoder_block(x: torch.Tensor, w, ops, config, attend) -> torch.Tensor:
    """One pre-norm decoder block on x [T, H] fp32 (updated in place by the residual adds and
    returned): w a stage.BlockWeights, ops the stage's backend, attend(qkv) → attention output
    [T, H_q·D] (the op-by-op stage and the GPU stage's static decode step attend differently).
    The normed input is not kept past its projection: the MLP's peak (planner/working_set.py) is
    its fused gate-up output, silu(gate)·up and the residual stream."""
    return block_output(x, attend(attention_input(x, w, ops, config)), w, ops, config)


def attention_input(x: torch.Tensor, w, ops, config) -> torch.Tensor:
    """A block's first half up to attention: qkv [T, (H_q + 2·H_kv)·D] of x [T, H], fp32 or, from
    a GPU stage's half-precision weights, in their dtype (TorchAttention.project widens it)."""
    return w.qkv(ops.rms_norm(x, w.input_norm, config.rms_norm_eps))


def block_output(x: torch.Tensor, attn: torch.Tensor, w, ops, config) -> torch.Tensor:
    """A block's rest after attention: x += o(attn), then x += down(silu(gate) · up) of its
    post-attention norm; x [T, H] fp32 updated in place and returned."""
    x = w.o(attn, x)
    del attn  # not held through the MLP, whose peak the plan prices (planner/working_set.py)
    gate, up = w.gate_up(ops.rms_norm(x, w.post_norm, config.rms_norm_eps)).split(config.intermediate_size, dim=-1)
    return w.down(ops.silu_mul(gate, up, w.down.input_dtype), x)


class TorchLinear:
    """y = x @ W.T + b with fp32 activations. W: [N, K] in the checkpoint dtype. Off the CPU a
    half-precision W takes its input in W's dtype (`input_dtype`: one cast, none where the
    producer wrote it so) and its tensor cores accumulate in fp32; widen=False leaves a product
    without bias in W's dtype there, for a consumer that widens it inside its own ops (the qkv
    projection: TorchAttention.project)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, widen: bool = True):
        self.weight = weight
        self.bias = None if bias is None else bias.float()  # fp32: adding it widens the product
        self.widen = widen
        self.out_features, self.in_features = weight.shape
        self.input_dtype = weight.dtype if weight.device.type != "cpu" else torch.float32

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, K] fp32 or half precision (taken as it is where that is `input_dtype`, else
        converted) → [T, N] fp32 (in W's dtype where widen=False, off the CPU, for a half-precision
        W without bias); with `residual` [T, N] fp32: residual += that, returned."""
        # a product added into the fp32 residual widens inside the add: one op fewer, the same sums
        y = self._project(x, widen=self.widen and residual is None)
        return y if residual is None else residual.add_(y)

    def _project(self, x: torch.Tensor, widen: bool) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float32:
            return F.linear(x.float(), w, self.bias)
        if w.device.type != "cpu":
            y = F.linear(x.to(w.dtype), w)
            if self.bias is not None:
                return y + self.bias  # the bias add widens
            return y.float() if widen else y
        x = x.float()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        rows = max(1, _UPCAST_CHUNK_ELEMS // self.in_features)
        for r0 in range(0, self.out_features, rows):
            r1 = min(r0 + rows, self.out_features)
            out[:, r0:r1] = x @ w[r0:r1].float().t()
        if self.bias is not None:
            out += self.bias
        return out
