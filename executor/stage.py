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

from executor.batch import StepBatch
from executor.kv_cache import KVCache
from executor.model_config import ModelConfig
from executor.backends import TorchBackend
from executor.rope import inverse_frequencies
from executor.staging import PinnedStaging
from executor.torch_ops import decoder_block

# [T, K] fp32 → [T, N] fp32 (a GPU stage's qkv: in its weights' dtype, torch_ops.TorchLinear);
# called as (x, residual) it adds into residual [T, N] in place.
Linear = Callable[..., torch.Tensor]


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

    @classmethod
    def of(cls, ops, *, input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down) -> "BlockWeights":
        """A block from its tensors (linears' weights [out, in] in the checkpoint's dtype, norms and
        biases fp32), its linears made by the stage's backend `ops`: qkv's product left in the
        weights' dtype, since attention widens q/k itself (TorchAttention.project)."""
        return cls(input_norm, ops.linear(qkv, qkv_bias, widen=False), q_norm, k_norm, ops.linear(o, None),
                   post_norm, ops.linear(gate_up, None), ops.linear(down, None))


@dataclass
class HeadWeights:
    norm: torch.Tensor  # [H] fp32
    lm_head: Linear  # H → V


class Stage:
    def __init__(self, config: ModelConfig, unit_start: int, unit_end: int, device: torch.device,
                 embedding: torch.Tensor | None, blocks: list[BlockWeights], head: HeadWeights | None,
                 kv: KVCache | None, ops=None, streamed=None):
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
        self.attention = self.ops.attention(config, kv) if blocks else None
        self.fused = self.ops.fused_blocks(config, blocks, kv, self.attention) if blocks else None  # None: op by op
        self._staging: dict[str, PinnedStaging] = {}  # CPU → CUDA copies, by what they carry
        # a CPU stage's prompt steps on the GPU, weights streamed (executor/streamed_prefill.py); None: here
        self.streamed = streamed

    def __repr__(self) -> str:
        return f"Stage(units {self.unit_start}..{self.unit_end - 1} on {self.device}, backend={self.backend})"

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden [T, H] fp32 → hidden [T, H] or logits [R, V]."""
        if self.embedding is not None:
            x = F.embedding(self._to_device(x, "token_ids"), self.embedding).float()
        else:
            x = self._receive(x)
        if self.blocks:
            for s in batch.slices:
                self.kv.reserve(s.seq_id, s.start + s.count)
            if self.streamed is not None and self.streamed.accepts(batch):
                x = self.streamed(x, batch)
            elif self.fused is not None and self.fused.accepts(batch):
                x = self.fused(x, batch)
            else:
                positions = self._to_device(batch.positions, "positions")
                cos, sin = self.attention.tables(self.inv_freq, positions)
                for i, block in enumerate(self.blocks):
                    x = self._block(x, block, i, batch, positions, cos, sin)
            for s in batch.slices:
                self.kv.mark_written(s.seq_id, s.start, s.count)
        if self.head is not None:
            if not batch.logit_rows.numel():  # a sub-step of a longer step with no sequence's last token
                return torch.empty(0, self.config.vocab_size, device=self.device)
            x = x[self._to_device(batch.logit_rows, "logit_rows")]
            x = self.head.lm_head(self.ops.rms_norm(x, self.head.norm, self.config.rms_norm_eps))
        return x

    def _receive(self, x: torch.Tensor) -> torch.Tensor:
        return self._to_device(x, "hidden")

    def _to_device(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x on this stage's device; from host memory to CUDA asynchronously, through a reused
        pinned buffer for each kind of input (executor/staging.py)."""
        if x.device == self.device:
            return x
        if self.device.type == "cuda" and x.device.type == "cpu":
            staging = self._staging.get(what)
            if staging is None:
                staging = self._staging[what] = PinnedStaging(self.device)
            return staging.to_device(x)
        return x.to(self.device)

    def _block(self, x, w: BlockWeights, layer, batch, positions, cos, sin):
        return decoder_block(x, w, self.ops, self.config, lambda qkv: self.attention(
            qkv, w.q_norm, w.k_norm, layer, batch, positions, cos, sin))
