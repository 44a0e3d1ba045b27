"""Streaming attention over KV pages (online softmax).

The KV of a sequence lives in fixed-size pages, some resident on the compute device and some
evicted to host memory. Rather than gathering them into one tensor, attention visits the pages
one at a time and keeps, per query row, a running max score `m`, running sum of exponentials
`s` and running weighted value sum `o`; when a page raises the max, `s` and `o` are rescaled by
exp(m_old - m_new). The result o / s equals softmax attention over all pages exactly (up to
float rounding), and only one page at a time needs to be on the device.
"""
from __future__ import annotations

from typing import Iterable

import torch

# (k [H_kv, n, D], v [H_kv, n, D], position of the chunk's first key)
KVChunk = tuple[torch.Tensor, torch.Tensor, int]


def streaming_attention(
    q: torch.Tensor,
    chunks: Iterable[KVChunk],
    scale: float,
    q_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over KV chunks visited in order.

    q: [T, H_q, D] (any float dtype; math in fp32). Query heads are grouped over KV heads as in
    GQA: query head h reads KV head h // (H_q / H_kv).
    q_positions: [T] absolute positions of the queries for causal masking (a key at position p
    is visible to a query at position >= p); None means every key is visible.
    Returns [T, H_q, D] fp32.
    """
    T, h_q, d = q.shape
    m = s = o = None
    for k, v, start in chunks:
        h_kv, n, _ = k.shape
        group = h_q // h_kv
        # q: [T, H_q, D] -> [H_kv, group*T, D]; row r of group g is query (r % T) of head g*group + r//T
        qg = q.float().permute(1, 0, 2).reshape(h_kv, group * T, d)
        scores = torch.matmul(qg, k.float().transpose(1, 2)) * scale  # [H_kv, group*T, n]
        if q_positions is not None:
            key_pos = torch.arange(start, start + n, device=q_positions.device)
            hidden = key_pos[None, :] > q_positions[:, None]  # [T, n]
            if bool(hidden.any()):
                scores = scores.masked_fill(hidden.repeat(group, 1)[None], float("-inf"))
        chunk_max = scores.amax(dim=-1, keepdim=True)  # [H_kv, group*T, 1]
        if m is None:
            m_new = chunk_max
        else:
            m_new = torch.maximum(m, chunk_max)
        # A row with every key masked so far has m_new = -inf; use 0 there so exp() gives 0, not NaN.
        safe_m = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - safe_m)
        pv = torch.matmul(p, v.float())  # [H_kv, group*T, D]
        if m is None:
            s, o = p.sum(dim=-1, keepdim=True), pv
        else:
            correction = torch.exp(m - safe_m)
            s = s * correction + p.sum(dim=-1, keepdim=True)
            o = o * correction + pv
        m = m_new
    if o is None:
        raise ValueError("attention over an empty KV sequence")
    out = o / s
    # [H_kv, group*T, D] -> [T, H_q, D]
    return out.reshape(h_q, T, d).permute(1, 0, 2)
