"""A stage: a contiguous range of partition units on one device.

Units are numbered as in the plan: 0 = token embedding, 1..L = transformer blocks, L+1 = final
norm + output projection. A stage takes token ids (if it owns the embedding) or the hidden state
from the previous stage, runs its blocks against its own KV cache, and returns the hidden state
or, if it owns the output projection, logits. Only the hidden state crosses between stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from executor.attention import streaming_attention
from executor.batch import StepBatch
from executor.kv_cache import KVCache
from executor.model_config import ModelConfig
from executor.backends import TorchBackend
from executor.rope import apply_rotary, inverse_frequencies, rotary_tables

Linear = Callable[[torch.Tensor], torch.Tensor]  # [T, K] fp32 → [T, N] fp32


@dataclass
class BlockWeights:
    input_norm: torch.Tensor  # [H] fp32
    qkv: Linear  # H → (H_q + 2·H_kv)·D, q/k/v fused
    q_norm: torch.Tensor | None  # [D] fp32 (Qwen3)
    k_norm: torch.Tensor | None
    o: Linear  # H_q·D → H
    post_norm: torch.Tensor  # [H] fp32
    gate_up: Linear  # H → 2·I, gate and up fused
    down: Linear  # I → H


@dataclass
class HeadWeights:
    norm: torch.Tensor  # [H] fp32
    lm_head: Linear  # H → V


class Stage:
    def __init__(self, config: ModelConfig, unit_start: int, unit_end: int, device: torch.device,
                 embedding: torch.Tensor | None, blocks: list[BlockWeights], head: HeadWeights | None,
                 kv: KVCache | None, ops=None):
        self.config = config
        self.unit_start, self.unit_end = unit_start, unit_end
        self.device = torch.device(device)
        self.embedding = embedding  # [V, H] checkpoint dtype
        self.blocks = blocks
        self.head = head
        self.kv = kv
        self.ops = ops or TorchBackend()
        self.backend = self.ops.name  # "helm" | "torch"
        self.first_block = max(unit_start, 1) - 1  # model layer index of blocks[0]
        self.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(self.device)
        self.scale = config.head_dim ** -0.5
        self._pinned: torch.Tensor | None = None  # staging buffer for CPU → CUDA hand-off

    def __repr__(self) -> str:
        return f"Stage(units {self.unit_start}..{self.unit_end - 1} on {self.device}, backend={self.backend})"

    @property
    def produces_logits(self) -> bool:
        return self.head is not None

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden [T, H] fp32 → hidden [T, H] or logits [R, V]."""
        if self.embedding is not None:
            x = F.embedding(x.to(self.device), self.embedding).float()
        else:
            x = self._receive(x)
        if self.blocks:
            for s in batch.slices:
                self.kv.reserve(s.seq_id, s.start + s.count)
            positions = batch.positions.to(self.device)
            cos, sin = rotary_tables(self.inv_freq, positions)
            for i, block in enumerate(self.blocks):
                x = self._block(x, block, i, batch, positions, cos, sin)
        if self.head is not None:
            x = x[batch.logit_rows.to(self.device)]
            x = self.head.lm_head(self.ops.rms_norm(x, self.head.norm, self.config.rms_norm_eps))
        return x

    def _receive(self, x: torch.Tensor) -> torch.Tensor:
        if x.device == self.device:
            return x
        if self.device.type == "cuda" and x.device.type == "cpu":
            # Stage the hidden state in a reused pinned buffer so the copy is asynchronous.
            if self._pinned is None or self._pinned.numel() < x.numel():
                self._pinned = torch.empty(x.numel(), dtype=x.dtype, pin_memory=True)
            staged = self._pinned[: x.numel()].view_as(x)
            staged.copy_(x)
            return staged.to(self.device, non_blocking=True)
        return x.to(self.device)

    def _block(self, x, w: BlockWeights, layer, batch, positions, cos, sin):
        cfg, ops = self.config, self.ops
        T = x.shape[0]
        h = ops.rms_norm(x, w.input_norm, cfg.rms_norm_eps)
        qkv = w.qkv(h)  # [T, (H_q + 2·H_kv)·D]
        q, k, v = qkv.split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), dim=-1)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)  # [T, H_q, D]
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)  # [T, H_kv, D]
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q = ops.rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)

        attn = torch.empty_like(q)  # [T, H_q, D]
        for s in batch.slices:
            rows = slice(s.offset, s.offset + s.count)
            self.kv.write(layer, s.seq_id, s.start, k[rows], v[rows])
            end = s.start + s.count
            # Decode (one query at the newest position) needs no mask: every cached key is visible.
            q_pos = positions[rows] if s.count > 1 else None
            attn[rows] = streaming_attention(q[rows], self.kv.chunks(layer, s.seq_id, end), self.scale, q_pos)
        x = ops.add_(x, w.o(attn.reshape(T, cfg.q_dim)))

        h = ops.rms_norm(x, w.post_norm, cfg.rms_norm_eps)
        gate, up = w.gate_up(h).split(cfg.intermediate_size, dim=-1)
        return ops.add_(x, w.down(ops.silu_mul(gate, up)))
