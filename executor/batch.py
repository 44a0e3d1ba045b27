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

    def split(self, max_rows: int, max_slice: int) -> list[tuple[int, int, "StepBatch"]]:
        """The step as consecutive sub-steps (first row, end row, sub-step) of at most `max_rows`
        tokens, a sequence's slice in pieces of at most `max_slice` tokens, one piece of a sequence
        in a sub-step (a later piece attends over the K/V an earlier sub-step wrote). Rows keep
        their order, so the sub-steps' outputs, concatenated, are the step's; logit rows must
        ascend (the engine's do: one per emitting slice, in slice order)."""
        if max_rows < 1 or max_slice < 1:
            raise ValueError(f"sub-steps need at least one row (max_rows={max_rows}, max_slice={max_slice})")
        rows = self.logit_rows.tolist()
        if rows != sorted(rows):
            raise ValueError("a step's logit rows must ascend to split it")
        pieces = [(s.seq_id, s.start + i, min(max_slice, s.count - i), s.offset + i)
                  for s in self.slices for i in range(0, s.count, max_slice)]
        groups: list[list[tuple]] = []
        for piece in pieces:
            group = groups[-1] if groups else None
            if group is None or sum(p[2] for p in group) + piece[2] > max_rows or \
                    any(p[0] == piece[0] for p in group):
                groups.append([piece])
            else:
                group.append(piece)
        out = []
        for group in groups:
            first, end = group[0][3], group[-1][3] + group[-1][2]
            logit = [r - first for r in rows if first <= r < end]
            out.append((first, end, StepBatch.build([(seq, start, n) for seq, start, n, _ in group], logit)))
        return out
