"""Reference twins of the CPU kernels: the same contracts in plain fp32 PyTorch, written for
clarity, not speed. Tests and benchmarks compare every kernel variant against these. (Being in
the package, they import only where the extension is built; executor/ops.py holds the executor's
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


def add_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b (the residual add), out of place."""
    return a + b
