"""Rotary position embedding: inverse frequencies (default and Llama 3 scaling) and rotation.

Frequencies are computed in fp32 from config values exactly as the reference implementation
defines them, so positions rotate identically to transformers.
"""
from __future__ import annotations

import math

import torch

from executor.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """inv_freq: [head_dim/2] fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated linearly in 1/wavelength.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def rotary_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim/2] fp32 for integer positions [T] (the CPU kernels' tables)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotation_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim] fp32 for integer positions [T], as `apply_rotary` takes them: cos
    for both halves of a head, sin with the sign of its half's term (-sin, then sin). Made once a
    step for every layer, so a layer's rotation costs three element-wise ops."""
    cos, sin = rotary_tables(inv_freq, positions)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate half-split pairs: (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin), as transformers
    does. x: [T, heads, head_dim]; cos/sin: [T, head_dim] from `rotation_tables`. out: where to
    write the result (any float dtype: the cast is the last ops'; it must not overlap x, which
    the second half's op reads after the first half's wrote); None: a new fp32 tensor.
    Three ops, and the swapped halves are read in place rather than copied."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = x * cos
    if out is None or torch.compiler.is_compiling():
        # in place (torch.compile takes no strided out=; Inductor fuses the copy below instead)
        rotated[..., :half].addcmul_(x[..., half:], sin[..., :half])
        rotated[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return rotated if out is None else out.copy_(rotated)
    torch.addcmul(rotated[..., :half], x[..., half:], sin[..., :half], out=out[..., :half])
    torch.addcmul(rotated[..., half:], x[..., :half], sin[..., half:], out=out[..., half:])
    return out
