"""A CPU stage's prompt chunks run on the GPU, its weights streamed over the link (DESIGN §10: a
policy per phase).

Why: a chunk of n prompt tokens costs each block 2·n·W FLOPs of GEMM, which a CPU does at a few
hundred GFLOP/s and a GPU at hundreds of TFLOP/s, while the block's W bytes cross the link in
W / B_h2d. From some chunk size on (the plan's `stream_min_rows`: where its cost model priced
the stream faster than the CPU's kernels) the CPU stage's blocks run on the GPU for that step:

- each projection's weight crosses in pieces of at most `piece_bytes` (whole rows) into a ring of
  `slots` device buffers, on a copy stream, while the compute stream multiplies the pieces before
  it (a piece of rows is a block of the output's columns, so the product is the same);
- norms, rotation and attention run in PyTorch on the GPU, attention by flash attention over the
  chunk's own keys and, for a chunk after cached ones, the sequence's cached keys: each of its
  pages (the stage's own host pages, page-locked) copied in once per layer, whatever the number
  of query blocks that read it;
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

import logging
import weakref

import torch
import torch.nn.functional as F

from executor.attention import TorchAttention, fused_prompt_attention, without_cudnn_attention
from executor.backends import TorchBackend
from executor.kv_cache import KVCache, lock_in_place, unlock
from executor.rope import inverse_frequencies
from executor.torch_ops import rms_norm, silu_mul
from planner.step_shape import PREFILL_CHUNK_TOKENS, STREAM_PIECE_BYTES, STREAM_SLOTS, streams

log = logging.getLogger(__name__)

_LINEARS = ("qkv", "o", "gate_up", "down")


class StreamedPrefill:
    """Prompt steps of a CPU stage's blocks on `device` (see the module docstring). A stage's
    `streamed` path: `accepts(batch)` says whether a step takes it, `(x, batch)` runs it."""

    def __init__(self, config, blocks, kv: KVCache, device: torch.device, min_rows: int,
                 piece_bytes: int = STREAM_PIECE_BYTES, slots: int = STREAM_SLOTS,
                 row_block: int = PREFILL_CHUNK_TOKENS):
        if min_rows < 1:
            raise ValueError(f"a streamed prompt step needs at least 1 row, got {min_rows}")
        if slots < 2:
            raise ValueError(f"streaming needs at least 2 device slots (one copied while one computes), got {slots}")
        self.config, self.blocks, self.kv = config, blocks, kv
        self.device = torch.device(device)
        self.min_rows = min_rows
        self.row_block = row_block  # rows made in fp32 at a time (norms, rotation, attention's queries, silu)
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
        return streams(sum(s.count for s in batch.slices if s.count > 1), self.min_rows)

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
        # the residual stream, fp32, to the device and back: the host reads it, and the stage's
        # kernels the K/V pages, once the device is done
        return self._layers(x.to(self.device, non_blocking=True), batch).to("cpu")

    def _layers(self, x: torch.Tensor, batch) -> torch.Tensor:
        """x [T, H] fp32 on the device through the stage's blocks, in place."""
        cfg, dev, rows_at_once = self.config, self.device, self.row_block
        h_q, h_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        positions = batch.positions.to(dev, non_blocking=True)
        cos, sin = self.attention.tables(self.inv_freq, positions)
        for layer, (w, small) in enumerate(zip(self.blocks, self._small)):
            # A step may hold STREAMED_STEP_TOKENS rows (planner/step_shape.py): whole-step arrays
            # are the products' outputs, in the weights' dtype; what is made in fp32 from them (norms,
            # rotation, attention, silu) is made for `row_block` rows at a time
            # (planner/working_set.streamed_step_bytes prices this).
            qkv = self._product(self._normed(x, small["input_norm"], w.qkv.weight.dtype), w.qkv.weight)
            attn = torch.empty(x.shape[0], h_q * d, dtype=qkv.dtype, device=dev)
            for s in batch.slices:
                # K/V of the sequence up to the slice's end: its cached keys copied in once, the
                # slice's own (views of the tail) as its query blocks make them
                visible = self._visible(layer, s, h_kv, d)  # [2, H_kv, start + count, D]
                own_k, own_v = visible[0, :, s.start:].transpose(0, 1), visible[1, :, s.start:].transpose(0, 1)
                for r0 in range(0, s.count, rows_at_once):
                    r1 = min(s.count, r0 + rows_at_once)
                    rows = slice(s.offset + r0, s.offset + r1)
                    part = qkv[rows].float()
                    if small["qkv_bias"] is not None:
                        part += small["qkv_bias"]
                    qk, v = self.attention.project(part, small["q_norm"], small["k_norm"], cos[rows], sin[rows])
                    own_k[r0:r1], own_v[r0:r1] = qk[:, h_q:], v  # in the cache's dtype: what decode will read
                    del part, v
                    # causal over every key up to the block's last query: flash attention on CUDA
                    end = s.start + r1
                    attn[rows] = fused_prompt_attention(qk[:, :h_q].reshape(r1 - r0, h_q * d), visible[0, :, :end],
                                                        visible[1, :, :end], s.start + r0, h_q, self.scale)
                    del qk
                self.kv.write(layer, s.seq_id, s.start, own_k, own_v)  # into its host pages, asynchronously
                del visible, own_k, own_v
            del qkv
            self._add(x, self._product(attn, w.o.weight))
            del attn
            self._add(x, self._product(self._mlp(x, w, small), w.down.weight))
        return x

    def _mlp(self, x: torch.Tensor, w, small) -> torch.Tensor:
        """silu(gate)·up of the normed x [T, I] in the weights' dtype: gate's and up's rows
        streamed in matching pieces, so no [T, 2·I] output is ever whole."""
        cfg = self.config
        weight, inter = w.gate_up.weight, cfg.intermediate_size
        xn = self._normed(x, small["post_norm"], weight.dtype)
        act = torch.empty(x.shape[0], inter, dtype=weight.dtype, device=self.device)
        cols = max(1, self.piece_bytes // (weight.shape[1] * weight.element_size()))
        for c0 in range(0, inter, cols):
            c1 = min(inter, c0 + cols)
            gate, up = self._product(xn, weight[c0:c1]), self._product(xn, weight[inter + c0:inter + c1])
            for r0 in range(0, x.shape[0], self.row_block):
                r = slice(r0, r0 + self.row_block)
                act[r, c0:c1] = silu_mul(gate[r].float(), up[r].float(), act.dtype)
            del gate, up
        return act

    def _normed(self, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """RMSNorm of x [T, H] fp32 in `dtype` (a product's input), made row_block rows at a time."""
        out = torch.empty(x.shape, dtype=dtype, device=self.device)
        for r0 in range(0, x.shape[0], self.row_block):
            r = slice(r0, r0 + self.row_block)
            out[r] = rms_norm(x[r], weight, self.config.rms_norm_eps)
        return out

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [T, H] fp32 += y (the weights' dtype), row_block rows at a time."""
        for r0 in range(0, x.shape[0], self.row_block):
            r = slice(r0, r0 + self.row_block)
            x[r] += y[r].float()

    def _product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, K] in the weights' dtype @ weight.T (weight [N, K] on the host, streamed a piece
        of rows at a time) → [T, N] in that dtype: as TorchLinear on the GPU, fp32 accumulation."""
        n, k = weight.shape
        rows = max(1, self.piece_bytes // (k * weight.element_size()))
        if rows >= n:  # one piece: its product is the output
            slot, piece = self._upload(weight)
            out = F.linear(x, piece)
            self._release(slot)
            return out
        out = torch.empty(x.shape[0], n, dtype=weight.dtype, device=self.device)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            slot, piece = self._upload(weight[r0:r1])
            out[:, r0:r1] = F.linear(x, piece)
            self._release(slot)
        return out

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

    def _visible(self, layer: int, s, h_kv: int, d: int) -> torch.Tensor:
        """[2, H_kv, start + count, D] in the cache's dtype on the device, for `layer` and the
        slice `s`: the sequence's cached K/V (positions < start) filled in, page by page, each
        page crossing the link once for all of the slice's query blocks (a page's layer slice
        copied in whole, asynchronously from a page-locked page, as a strided host slice would
        be staged through pageable memory); the slice's own positions left for the caller.
        Device memory of the sequence's keys, which planner/working_set.py prices at the plan's
        context, and no scores or masks: flash attention reads it as it is."""
        visible = torch.empty(2, h_kv, s.start + s.count, d, dtype=self.kv.dtype, device=self.device)
        page = self.kv.page_size
        for i, p in enumerate(self.kv.pages_of(s.seq_id)[:-(-s.start // page)]):
            a = i * page
            n = min(page, s.start - a)
            visible[:, :, a:a + n] = p.data[layer].to(self.device, non_blocking=True)[:, :, :n]
        return visible
