"""A CPU stage's prompt chunks run on the GPU, its weights streamed over the link (DESIGN §10: a
policy per phase).

Why: a chunk of n prompt tokens costs each block 2·n·W FLOPs of GEMM, which a CPU does at a few
hundred GFLOP/s and a GPU at hundreds of TFLOP/s, while the block's W bytes cross the link in
W / B_h2d. From some chunk size on (the plan's `stream_min_rows`: where its cost model priced
the stream faster than the CPU's kernels) the CPU stage's blocks run on the GPU for that step:

- each projection's weight crosses in pieces of at most `piece_bytes` (whole rows) into a ring of
  `slots` device buffers, on a copy stream, while the compute stream multiplies the pieces before
  it (a piece of rows is a block of the output's columns, so the product is the same);
- norms, rotation and attention run in PyTorch on the GPU: a chunk with nothing cached before it
  by flash attention, a later one streaming over the sequence's cached pages (the stage's own
  host pages, page-locked), copied in one at a time, then over its own keys;
- the chunk's K/V go back into those host pages, where the stage's decode steps (our kernels)
  read them, and the hidden state goes back to the host for the next stage.

Decode keeps the weights where they are: a decode step reads every weight once per token, so
streaming it would cost the whole link time for one token. The weights are copied from where the
stage holds them, page-locked in place (the loader gives a streaming stage's projections pages of
their own: executor/host_memory.py), so no second copy of them exists. The device memory this
takes is the slot ring beside the GPU stage's own working set (planner/working_set.py prices it).

On a machine without CUDA the same code runs with CPU tensors for the device (the tests), copies
and all, without streams.
"""
from __future__ import annotations

import itertools
import logging
import weakref

import torch
import torch.nn.functional as F

from executor.attention import (TorchAttention, fused_prompt_attention, streaming_attention,
                                without_cudnn_attention)
from executor.backends import TorchBackend
from executor.kv_cache import KVCache, lock_in_place, unlock
from executor.rope import inverse_frequencies
from executor.torch_ops import rms_norm, silu_mul
from planner.step_shape import STREAM_PIECE_BYTES, STREAM_SLOTS

log = logging.getLogger(__name__)

_LINEARS = ("qkv", "o", "gate_up", "down")


class StreamedPrefill:
    """Prompt steps of a CPU stage's blocks on `device` (see the module docstring). A stage's
    `streamed` path: `accepts(batch)` says whether a step takes it, `(x, batch)` runs it."""

    def __init__(self, config, blocks, kv: KVCache, device: torch.device, min_rows: int,
                 piece_bytes: int = STREAM_PIECE_BYTES, slots: int = STREAM_SLOTS):
        if min_rows < 1:
            raise ValueError(f"a streamed prompt step needs at least 1 row, got {min_rows}")
        if slots < 2:
            raise ValueError(f"streaming needs at least 2 device slots (one copied while one computes), got {slots}")
        self.config, self.blocks, self.kv = config, blocks, kv
        self.device = torch.device(device)
        self.min_rows = min_rows
        self.scale = config.head_dim ** -0.5
        self.ops = TorchBackend()
        self.attention = TorchAttention(config, None, self.ops)  # its q/k norm and rotation
        self.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(self.device)
        on = dict(device=self.device)
        # what a block needs beside its projections is small: on the device for the stage's life
        self._small = [dict(input_norm=b.input_norm.to(**on), post_norm=b.post_norm.to(**on),
                            q_norm=None if b.q_norm is None else b.q_norm.to(**on),
                            k_norm=None if b.k_norm is None else b.k_norm.to(**on),
                            qkv_bias=None if b.qkv.bias is None else b.qkv.bias.float().to(**on))
                       for b in blocks]
        weights = [getattr(b, name).weight for b in blocks for name in _LINEARS]
        self.weight_bytes = sum(w.numel() * w.element_size() for w in weights)  # what crosses per streamed step
        # no larger than the largest weight, a row of the widest at least
        self.piece_bytes = max(min(piece_bytes, max(w.numel() * w.element_size() for w in weights)),
                               max(w[0].numel() * w.element_size() for w in weights))
        self._slots = [torch.empty(self.piece_bytes, dtype=torch.uint8, **on) for _ in range(slots)]
        self._next_slot = 0
        self._locked: list[torch.Tensor] = []
        self._copy_stream = None
        if self.device.type == "cuda":
            without_cudnn_attention()  # as the GPU stage: its flash kernels, not cuDNN's (executor/attention.py)
            # copied by DMA from where they are: page-locked in place (pages of their own, the
            # loader's); the finalizer first, so a lock that fails midway lets go of those before it
            weakref.finalize(self, unlock, self._locked)
            for w in weights:
                self._locked.append(lock_in_place(w, "weights streamed to the GPU"))
            self._copy_stream = torch.cuda.Stream(self.device)
            self._slot_free = [torch.cuda.Event() for _ in self._slots]  # the compute stream is done with it
            for e in self._slot_free:
                e.record(torch.cuda.current_stream(self.device))

    @property
    def device_bytes(self) -> int:
        """Device memory held between steps (the slot ring; norms and biases are a few KiB)."""
        return len(self._slots) * self.piece_bytes

    def accepts(self, batch) -> bool:
        """A step whose prompt chunks (slices of more than one token) hold min_rows tokens: the
        size the plan priced streamed. Decode steps, however many sequences, stay on the CPU (the
        plan prices decode there); a decode riding along with prompt chunks streams with them."""
        return sum(s.count for s in batch.slices if s.count > 1) >= self.min_rows

    def __call__(self, x: torch.Tensor, batch) -> torch.Tensor:
        """x: [T, H] fp32 on the host → [T, H] fp32 on the host after the stage's blocks, their K/V
        of the step's tokens in the stage's pages (the stage marks them written)."""
        try:
            return self._run(x, batch)
        except BaseException:
            if self._copy_stream is not None:
                # copies into and out of the sequences' page-locked pages may still be queued: they
                # land before the engine frees those pages for others
                torch.cuda.synchronize(self.device)
            raise

    def _run(self, x: torch.Tensor, batch) -> torch.Tensor:
        cfg, dev = self.config, self.device
        h_q, d = cfg.num_heads, cfg.head_dim
        x = x.to(dev, non_blocking=True)
        positions = batch.positions.to(dev, non_blocking=True)
        cos, sin = self.attention.tables(self.inv_freq, positions)
        for layer, (w, small) in enumerate(zip(self.blocks, self._small)):
            qkv = self._linear(rms_norm(x, small["input_norm"], cfg.rms_norm_eps), w.qkv.weight, small["qkv_bias"])
            qk, v = self.attention.project(qkv, small["q_norm"], small["k_norm"], cos, sin)
            del qkv
            # in the cache's dtype: what the stage's decode steps will read of these tokens
            k, v = qk[:, h_q:].to(self.kv.dtype), v.to(self.kv.dtype)
            q = qk[:, :h_q].reshape(-1, h_q * d)
            attn = torch.empty(x.shape[0], h_q * d, dtype=torch.float32, device=dev)
            for s in batch.slices:
                rows = slice(s.offset, s.offset + s.count)
                own = (k[rows].transpose(0, 1), v[rows].transpose(0, 1), s.start)  # [H_kv, count, D] each
                if s.start == 0:  # nothing cached: the chunk's own keys, flash attention on CUDA
                    attn[rows] = fused_prompt_attention(q[rows], own[0], own[1], 0, h_q, self.scale).float()
                else:
                    # over the cached pages one at a time, then its own keys (online softmax): device
                    # memory of a few pages, not of the whole context, as the GPU stage's prompt
                    # chunks stream over pages parked on the host (planner/working_set.py prices that)
                    pages = itertools.chain(self._cached(layer, s.seq_id, s.start), [own])
                    attn[rows] = streaming_attention(q[rows].view(s.count, h_q, d), pages, self.scale,
                                                     positions[rows], first_query=s.start).reshape(s.count, h_q * d)
                self.kv.write(layer, s.seq_id, s.start, k[rows], v[rows])  # into its host pages, asynchronously
            del q, qk, k, v
            x = self._linear(attn, w.o.weight, residual=x)
            del attn
            gate_up = self._linear(rms_norm(x, small["post_norm"], cfg.rms_norm_eps), w.gate_up.weight)
            gate, up = gate_up.split(cfg.intermediate_size, dim=-1)
            x = self._linear(silu_mul(gate, up), w.down.weight, residual=x)
            del gate_up, gate, up
        # the host reads x, and the stage's kernels the K/V pages, once the device is done
        return x.to("cpu")

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] fp32 @ weight.T (weight [N, K] on the host, streamed a piece of rows at a time)
        + bias → [T, N] fp32; with residual: residual += that, returned. As TorchLinear on the GPU:
        the input in the weights' dtype, fp32 accumulation."""
        n, k = weight.shape
        x_in = x.to(weight.dtype) if weight.dtype != torch.float32 else x
        out = torch.empty(x.shape[0], n, dtype=weight.dtype, device=self.device)
        rows = max(1, self.piece_bytes // (k * weight.element_size()))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            slot, piece = self._upload(weight[r0:r1])
            out[:, r0:r1] = F.linear(x_in, piece)
            self._release(slot)
        y = out.float() if out.dtype != torch.float32 else out
        if bias is not None:
            y = y + bias
        return y if residual is None else residual.add_(y)

    def _upload(self, piece: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(slot, piece on the device): piece (host rows of a weight, contiguous) in the ring's next
        slot. On CUDA copied on the copy stream once the compute stream is done with the slot's
        last piece (`_release`), the compute stream waiting for the copy."""
        i = self._next_slot
        self._next_slot = (i + 1) % len(self._slots)
        on_device = self._slots[i][:piece.numel() * piece.element_size()].view(piece.dtype).view(piece.shape)
        if self._copy_stream is None:
            return i, on_device.copy_(piece)
        self._copy_stream.wait_event(self._slot_free[i])
        with torch.cuda.stream(self._copy_stream):
            on_device.copy_(piece, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        torch.cuda.current_stream(self.device).wait_event(ready)
        return i, on_device

    def _release(self, slot: int) -> None:
        """The product reading `slot` is queued: a later upload into it waits for that product."""
        if self._copy_stream is not None:
            self._slot_free[slot].record(torch.cuda.current_stream(self.device))

    def _cached(self, layer: int, seq_id, length: int):
        """K and V of the sequence's positions < length for `layer`, a page at a time on the device
        (k, v [H_kv, n, D], first position): each page's layer slice copied in whole, as it is
        needed (asynchronously from a page-locked page), let go once attention has read it."""
        page = self.kv.page_size
        for i, p in enumerate(self.kv.pages_of(seq_id)[:-(-length // page)]):
            n = min(page, length - i * page)
            kv = p.data[layer].to(self.device, non_blocking=True)  # [2, H_kv, P, D]
            yield kv[0, :, :n], kv[1, :, :n], i * page
