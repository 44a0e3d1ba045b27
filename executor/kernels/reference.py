"""Reference twins of the CPU kernels: the same contracts in plain fp32 PyTorch, written for
clarity, not speed. Tests and benchmarks compare every kernel variant against these. (Being in
the package, they import only where the extension is built; executor/torch_ops.py holds the executor's
own PyTorch path.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, K] fp32, weight: [N, K] any float dtype, bias: [N] → [B, N] fp32 (weight upcast)."""
    y = x.float() @ weight.float().t()
    return y + bias.float() if bias is not None else y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] fp32, weight: [H] → x * rsqrt(mean(x², -1) + eps) * weight, fp32."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)) * weight.float()


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32."""
    return F.silu(gate.float()) * up.float()


def rope_qk_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                eps: float = 1e-6) -> torch.Tensor:
    """qkv: [T, ≥(Hq + Hkv)·D] → a copy with each q head RMS-normed by q_norm and each k head by
    k_norm (if given), then rotated: halves (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin)."""
    T, D = qkv.shape[0], 2 * cos.shape[1]
    out = qkv.clone()
    heads = out[:, :(num_heads + num_kv_heads) * D].view(T, num_heads + num_kv_heads, D)
    if q_norm is not None:
        heads[:, :num_heads] = rms_norm_ref(heads[:, :num_heads], q_norm, eps)
        heads[:, num_heads:] = rms_norm_ref(heads[:, num_heads:], k_norm, eps)
    x1, x2 = heads[..., : D // 2].clone(), heads[..., D // 2:].clone()
    c, s = cos[:, None, :], sin[:, None, :]
    heads[..., : D // 2] = x1 * c - x2 * s
    heads[..., D // 2:] = x2 * c + x1 * s
    return out


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] at positions start..start+T-1; k, v: [start+T, Hkv, D] (any float dtype) →
    [T, Hq, D] fp32: softmax(q·kᵀ·scale) v over keys at positions <= the query's, with query head i
    reading KV head i // (Hq / Hkv)."""
    T, hq, _ = q.shape
    group = hq // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), k.transpose(1, 2)) * scale  # [Hq, T, S]
    key_pos = torch.arange(k.shape[1])
    q_pos = torch.arange(start, start + T)
    scores = scores.masked_fill(key_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1)
