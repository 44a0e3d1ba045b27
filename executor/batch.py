"""What one engine step asks the stages to compute.

A step processes a flat list of tokens from several sequences: decode steps contribute one
token each, prefill contributes a chunk of prompt tokens. The stages see only this structure,
never requests or sampling state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSlice:
    seq_id: object
    start: int  # position of the slice's first token in its sequence
    count: int  # tokens of this sequence in the step
    offset: int  # row of the first token in the flat [T, ...] step tensors


@dataclass(frozen=True)
class StepBatch:
    slices: tuple[SeqSlice, ...]
    positions: torch.Tensor  # [T] int64, absolute position of every token
    logit_rows: torch.Tensor  # [R] int64, rows whose next-token logits are needed

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(cls, parts: list[tuple[object, int, int]], logit_rows: list[int] | None = None) -> "StepBatch":
        """parts: (seq_id, start, count). logit_rows default: the last token of every part."""
        slices, positions, offset = [], [], 0
        for seq_id, start, count in parts:
            slices.append(SeqSlice(seq_id, start, count, offset))
            positions.extend(range(start, start + count))
            offset += count
        if logit_rows is None:
            logit_rows = [s.offset + s.count - 1 for s in slices]
        return cls(
            slices=tuple(slices),
            positions=torch.tensor(positions, dtype=torch.int64),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64),
        )
