"""VRAM the GPU stage works in beyond its weights and KV pages (DESIGN §5 feasibility); and
the host memory a CPU stage works in (`cpu_working_bytes`), priced the same way.

A split fits the GPU when weights + device KV pages + this working set fit the usable VRAM. The
usable VRAM a profile measures is what is free after the CUDA context and cuBLAS's workspace
(planner/profile.py), so nothing else covers what the executor allocates while it steps:

- the activations of the largest step (step_shape.step_tokens: the engine runs none larger) or
  of a decode step of every running sequence, layer by layer: per token, the
  values the model's own graph holds at its peak (UnitIR.work_values_per_token), in fp32 as the
  executor holds them, times ACTIVATION_WIDENING: the executor fuses gate and up into one
  output and keeps it whole while silu(gate)·up is made, where the graph frees each sooner;
- one sequence's prompt chunk at a time through attention, per layer (beside the activations,
  though their peak is the MLP's: a bound, not an estimate). Fused, where the profile says flash
  attention runs (GpuProfile.flash_attention) for half-precision weights, for a sequence no
  longer than the device pages hold (pages another sequence's parked come back into the gather,
  two at a time in transit), so over at most the device pages' tokens: its K/V gathered and the
  kernel's log-sum-exp per query head; flash attention needs no mask (executor/attention.py).
  A page at a time through flash attention, where a sequence can outgrow the device pages
  (offload): two pages of K/V, the regrouped queries and the running output
  (segmented_prompt_attention_bytes). Streamed where flash attention does not run (fp32
  weights, a GPU or head size without its kernels): a page of fp32 scores per query head and
  the masks that hide its future keys, its K or V in fp32, three pages' device copies (the
  last, this and the prefetched one), and the grouped queries, running output and a page's
  share of it in fp32. The largest of those that may run, all where the profile does not say
  whether flash attention runs;
- the logits of every sequence in a step (the head's values per token), in fp32 beside the
  half-precision output they are cast from;
- the decode step's CUDA graphs (executor/device_step.py): their private pool keeps the largest
  bucket's K/V gather, mask and activations for as long as the graphs live;
- the device pool's scratch page, where the static decode step's padded rows write;
- the cuBLAS workspace of the stream the graphs are captured on (GpuProfile.stream_workspace_bytes:
  the profile's usable VRAM already lost the default stream's).

tests/executor/test_working_set.py holds the activation term against the executor's own decoder
block, tools/bench_gpu.py and tests/executor/test_cuda.py against what CUDA allocates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.ir import UnitIR
from planner.step_shape import (MAX_STEP_TOKENS, PREFILL_CHUNK_TOKENS, STREAM_PIECE_BYTES, bucket, longest_gather,
                                running_sequences, step_tokens)

# The executor's activation values per token over the model graph's at its peak (see the module
# docstring): a gated MLP's 4·I + H values against 3·I + H, at most 4/3.
ACTIVATION_WIDENING = 4 / 3
FP32_BYTES = 4
FLASH_MAX_HEAD_DIM = 256  # PyTorch's flash attention kernels take heads up to this size
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STREAM_ROWS_GRAIN = 64  # a streamed step's most tokens, rounded down to a multiple of this (a plan's round figure)


@dataclass(frozen=True)
class _Stage:
    """What both prices read off a stage's units: its dtype's bytes, its blocks' attention shape
    (K+V bytes per token of one layer, 4·H_q·D FLOPs per context token, query heads per KV head,
    query heads), its head, and how many sequences and tokens of a prompt chunk a step may hold."""
    b: int
    blocks: bool
    head: UnitIR | None
    sequences: int
    chunk: int
    kv_token: int = 0
    attn: int = 0
    group: int = 0
    heads: int = 0

    @classmethod
    def of(cls, units: tuple[UnitIR, ...], dtype: str | None, context: int, budget_pages: int) -> "_Stage":
        b = DTYPE_BYTES.get(dtype or "bfloat16", 2)
        blocks = [u for u in units if u.kind == "block"]
        shape = cls(b=b, blocks=bool(blocks), head=units[-1] if units[-1].kind == "head" else None,
                    sequences=running_sequences(budget_pages),
                    chunk=min(PREFILL_CHUNK_TOKENS, max(1, context)))
        if not blocks:
            return shape
        kv_token = max(u.kv_bytes_per_token for u in blocks)            # K and V of one layer
        attn = max(u.attn_flops_per_context_token for u in blocks)      # 4·H_q·D
        return replace(shape, kv_token=kv_token, attn=attn,
                       group=attn * b // (2 * kv_token) if kv_token else 0,  # H_q / H_kv, K/V being 2·H_kv·D·b
                       heads=max(u.attn_heads or 0 for u in blocks))

    @property
    def head_dim(self) -> int:
        return self.attn // (4 * self.heads) if self.heads else 0

    def streamed(self, page: int) -> int:
        return streamed_prompt_attention_bytes(self.chunk, page, self.kv_token, self.heads, self.group, self.attn,
                                               self.b)


def gpu_working_bytes(units: tuple[UnitIR, ...], *, dtype: str | None, batch: int, context: int,
                      page_size_tokens: int, budget_pages: int, device_pages: int, device_page_bytes: int,
                      stream_workspace_bytes: int = 0, flash_attention: bool | None = None,
                      streamed_step: int = 0) -> int:
    """Bytes the GPU stage `units` (its units, in order) works in for `batch` sequences of
    `context` tokens: `budget_pages` KV pages for all its sequences (device and host; short
    sequences share them, so as many may run), `device_pages` of them in VRAM,
    `device_page_bytes` one page over every block of the stage; `stream_workspace_bytes` what a
    second stream's GEMMs keep (0: not measured); `flash_attention` whether PyTorch's flash
    attention runs on the GPU (GpuProfile.flash_attention; None: not known);
    `streamed_step` what a CPU stage's largest prompt step streamed to the GPU takes
    (streamed_step_bytes below: it runs before the stage's own part of that step, which takes
    it in sub-steps of the step priced here, so the larger of the two)."""
    if not units:
        return 0
    # the fit prices steps at mean batch sizes and contexts: memory is whole pages and sequences
    batch, context, budget_pages, device_pages = (math.ceil(x) for x in (batch, context, budget_pages, device_pages))
    st = _Stage.of(units, dtype, context, budget_pages)
    per_token = activation_bytes_per_token(units)
    total = max(step_tokens(batch, context), st.sequences) * per_token + st.sequences * _logits_bytes(st.head, st.b)
    if st.blocks:
        # where flash attention runs (half precision, a head it has kernels for) the executor
        # gathers a sequence no longer than the device pool holds (executor/kv_cache.py gathers)
        # and takes a longer one's chunks a page at a time (segmented); elsewhere it streams:
        # priced by what the profile says of flash attention, all of them where it does not know
        flash = None if flash_attention is None else (flash_attention and st.b < FP32_BYTES
                                                      and 0 < st.head_dim <= FLASH_MAX_HEAD_DIM)
        resident = min(context, longest_gather(device_pages, page_size_tokens))
        fuses = flash is not False and resident > 0
        segments = flash is not False and resident < context
        streams = flash is not True
        # a gather takes parked pages back a page at a time (one copied in, the next on its way)
        parked_in = 2 * page_size_tokens * st.kv_token if device_pages < budget_pages else 0
        fused = fused_prompt_attention_bytes(resident, st.chunk, st.kv_token, st.heads) + parked_in
        segmented = segmented_prompt_attention_bytes(st.chunk, page_size_tokens, st.kv_token, st.heads, st.attn, st.b)
        total += max(fused if fuses else 0, segmented if segments else 0,
                     st.streamed(page_size_tokens) if streams else 0)
    total = max(total, streamed_step)  # the step's own, or a streamed one's before it
    if st.blocks and device_pages:
        gathered = bucket(device_pages) * page_size_tokens         # keys one decode graph reads
        rows = min(bucket(st.sequences), bucket(device_pages))
        # each key gathered, and its entry in the step's additive mask (the cache's dtype)
        total += gathered * (st.kv_token + st.b) + rows * per_token + device_page_bytes + stream_workspace_bytes
    return total


def cpu_working_bytes(units: tuple[UnitIR, ...], *, dtype: str | None, batch: int, context: int,
                      page_size_tokens: int, budget_pages: int, gpu_units: tuple[UnitIR, ...] = (),
                      streamed_rows: int = 0) -> int:
    """Host memory the CPU stage `units` works in beside its weights and KV pages, for `batch`
    sequences of `context` tokens (`budget_pages` KV pages), the GPU stage being `gpu_units`:
    - the activations of its largest step: bounded by the plan's batch where a GPU stage runs,
      else by a chunk for every sequence the KV budget can hold (and by the pages' tokens), up to
      the engine's MAX_STEP_TOKENS. Priced in the GPU stage's layout: the CPU kernels write their
      fp32 outputs directly and the torch paths widen weights a bounded tile at a time (measured
      below the price on AVX2), except the AVX512-BF16 GEMV, whose threads each split the whole
      batch of a step wider than a decode (left unpriced, an open fault of that kernel);
    - one layer of a prompt chunk's attention, fused (its K/V gathered, widened to fp32 for an
      fp16 cache, and its mask; the CPU's fused kernel takes GQA without tiling) or streamed (the
      torch backend streams prompt chunks), whichever is larger;
    - the logits of every sequence; with a GPU stage, the hidden states handed to it (fp32,
      pinned) and, where it has the head, its logits copied back (fp32): the host's only working
      set where every unit is on the GPU (the engine samples on the host);
    - where its prompt steps of up to `streamed_rows` tokens stream to the GPU
      (executor/streamed_prefill.py), such a step's hidden states on the host instead of its
      activations: the embedding's output and the blocks' returned, in fp32."""
    batch, context, budget_pages = (math.ceil(x) for x in (batch, context, budget_pages))
    if not units:
        head = gpu_units[-1] if gpu_units and gpu_units[-1].kind == "head" else None
        return _logits_back(head, running_sequences(budget_pages))
    st = _Stage.of(units, dtype, context, budget_pages)
    tokens = (step_tokens(batch, context) if gpu_units
              else min(MAX_STEP_TOKENS, st.sequences * st.chunk, budget_pages * page_size_tokens))
    steps = max(tokens, st.sequences)
    hidden_fp32 = units[-1].act_bytes_per_token * FP32_BYTES // st.b
    total = max(steps * activation_bytes_per_token(units), 2 * streamed_rows * hidden_fp32) + \
        st.sequences * _logits_bytes(st.head, st.b)
    if st.blocks:
        widened = 2 * context * st.kv_token if dtype == "float16" else 0  # prompt_attention_dtype: fp32
        fused = context * st.kv_token + widened + st.chunk * context
        total += max(fused, st.streamed(page_size_tokens))
    if gpu_units:
        total += steps * hidden_fp32
        total += _logits_back(gpu_units[-1] if gpu_units[-1].kind == "head" else None, st.sequences)
    return total


def _logits_back(head: UnitIR | None, sequences: int) -> int:
    """The fp32 logits of `sequences` copied to the host from a GPU stage with the head."""
    return sequences * FP32_BYTES * (head.work_values_per_token or 0) if head is not None else 0


def _logits_bytes(head: UnitIR | None, dtype_bytes: int) -> int:
    """One sequence's logits: the head's values in fp32, beside the half-precision output they
    are cast from."""
    if head is None:
        return 0
    cast = dtype_bytes if dtype_bytes < FP32_BYTES else 0
    return (FP32_BYTES + cast) * (head.work_values_per_token or 0)


def fused_prompt_attention_bytes(context: int, chunk: int, kv_token: int, heads: int) -> int:
    """One layer of a prompt chunk through the GPU stage's fused attention (executor/attention.py,
    fused_prompt_attention: flash attention, lower-right causal, no mask): the sequence's K/V
    gathered over `context` tokens and the kernel's fp32 log-sum-exp per query head and query
    (its queries and output in the cache's dtype are the activations'). Not priced: the fp32
    accumulators flash attention splits a short chunk's keys into when its heads × 64-query
    blocks cannot fill the GPU (a few MiB, growing with the number of SMs;
    tests/executor/test_cuda.py measures them)."""
    return context * kv_token + FP32_BYTES * heads * chunk


def segmented_prompt_attention_bytes(chunk: int, page: int, kv_token: int, heads: int, attn_flops: int,
                                     dtype_bytes: int) -> int:
    """One layer of a prompt chunk of a sequence longer than the device pool holds, where flash
    attention runs (executor/attention.py, segmented_prompt_attention), at its peak, over the
    cached pages: two pages of K/V on the device (one read, the next on its way) and, per query
    value (H_q·D of them a query), the queries regrouped, a page's output and the running one in
    fp32 (4 bytes and two of the dtype's; in half precision also the queries cast and a page's
    output widened); five fp32 log-sum-exps per query head and query. Over the chunk's own keys
    it holds less (tests/executor/test_working_set.py measures both on the meta device)."""
    widened = dtype_bytes + FP32_BYTES if dtype_bytes < FP32_BYTES else 0
    return (chunk * (attn_flops // 4) * (FP32_BYTES + 2 * dtype_bytes + widened) + 2 * page * kv_token
            + 5 * FP32_BYTES * heads * chunk)


def streamed_prompt_attention_bytes(chunk: int, page: int, kv_token: int, heads: int, group: int,
                                    attn_flops: int, dtype_bytes: int) -> int:
    """One layer of a prompt chunk through streaming attention (executor/attention.py,
    streaming_attention), page by page: a page of fp32 scores per query head, the booleans hiding
    its future keys (and their tiling over `group`), its K or V in fp32, three pages' device
    copies, and the grouped queries, running output and a page's share of it (H_q·D values per
    query, attn_flops / 4) in fp32."""
    return (FP32_BYTES * heads * chunk * page + (1 + group) * chunk * page
            + page * kv_token * FP32_BYTES // (2 * dtype_bytes) + 3 * page * kv_token
            + 3 * FP32_BYTES * chunk * attn_flops // 4)


def streamed_step_bytes(units: tuple[UnitIR, ...], rows: int, page: int, dtype: str | None, context: int,
                        row_block: int = PREFILL_CHUNK_TOKENS, piece_bytes: int = STREAM_PIECE_BYTES) -> int:
    """Device memory a CPU stage's prompt step of `rows` tokens takes streamed through its blocks
    `units` (executor/streamed_prefill.py), beside its ring of weight pieces: the residual stream,
    positions and the rotation's tables; the products' outputs for every row in the weights'
    dtype, at the larger of attention (qkv and the attention output, and one sequence's K/V up to
    the step's last token, `context` at most: its cached keys copied in for flash attention, its
    own made into the tail) and the MLP (normed input, silu(gate)·up, one piece of gate's and of
    up's columns); the fp32 values made from them a `row_block` of rows at a time (a piece's gate
    and up and silu, or qkv widened, normed and rotated); and one query block's flash attention
    (its queries and output in the weights' dtype), or two pages of K/V in transit (a cached
    page's copy in, a page of the step's own on its way back). The block's dimensions come off
    its IR: H from the hidden state it hands on, the attention's from its KV and FLOPs per
    context token, I from what its weights leave."""
    b = DTYPE_BYTES.get(dtype or "bfloat16", 2)
    row_block = min(rows, row_block)
    most = 0
    for u in units:
        if u.kind != "block":
            continue
        hidden = u.act_bytes_per_token // b
        q_width, kv_width = u.attn_flops_per_context_token // 4, u.kv_bytes_per_token // (2 * b)  # H_q·D, H_kv·D
        qkv = q_width + 2 * kv_width
        inter = max(0, (u.weight_bytes // b - hidden * (qkv + q_width)) // (3 * hidden))  # norms: < 1 of it
        cols = max(1, min(inter, piece_bytes // (hidden * b)))                            # a piece's columns
        # a query block's rows: qkv widened, then its queries and keys normed and rotated (fp32
        # copies), or its rotated queries and keys held while flash attention reads its queries
        project = row_block * FP32_BYTES * (qkv + 3 * (q_width + kv_width))
        attend = row_block * FP32_BYTES * (q_width + kv_width) + 2 * row_block * q_width * b
        in_transit = 2 * page * u.kv_bytes_per_token
        keys = fused_prompt_attention_bytes(max(1, context), row_block, u.kv_bytes_per_token, u.attn_heads or 1)
        attention = rows * b * (qkv + q_width) + keys + max(project, attend, in_transit)
        mlp = rows * b * (hidden + inter + 2 * cols) + row_block * cols * (3 * FP32_BYTES + b)
        # the rotation's cos and sin for every row, and its int64 position
        tables = 2 * rows * FP32_BYTES * q_width // (u.attn_heads or 1) + 8 * rows
        most = max(most, rows * hidden * FP32_BYTES + tables + max(attention, mlp))
    return most


def activation_bytes_per_token(units: tuple[UnitIR, ...]) -> int:
    """The executor's activation bytes per token in the widest of `units` but the head (whose
    logits only the last token of each sequence computes)."""
    values = max((u.work_values_per_token or 0 for u in units if u.kind != "head"), default=0)
    return math.ceil(values * FP32_BYTES * ACTIVATION_WIDENING)
