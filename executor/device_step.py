"""The GPU stage's decode step at static shapes, replayed as CUDA graphs.

Why: on a fast GPU a decode step of a few tokens is bound by kernel launches (dozens per block,
each costing microseconds of Python and driver time), not by HBM. A captured CUDA graph replays
every kernel of the step at once, but it needs every shape and address fixed. So this step:

- pads the batch to a bucket of 1, 2, 4, ... rows and each sequence's pages to a bucket of
  1, 2, 4, ... pages (one graph per pair of buckets, captured at load for the plan's batch and
  context; a step outside them runs the same code eagerly);
- addresses KV pages by their slot in the device pool's slab (kv_cache.PagePool), from one
  index tensor copied to the device before the replay;
- writes each row's new K/V into (its page's slot, its position in the page) with one index_put
  per layer; padded rows write to the slab's scratch slot, which is never a page;
- attends with SDPA over the gathered pages, a key visible where its position is at or before
  the query's (later slots of the last page and padded pages are hidden by the same test); with
  HELM_PAGED_DECODE=1, by executor/paged_decode.py's kernels straight over the slab (same test);
- launches few kernels a block, since even a replayed kernel costs microseconds: what the layers
  share (rotary tables, mask, page table) is made once a step and casts ride inside the ops
  around them (tests/executor/test_device_step.py counts them); with HELM_COMPILE=1 each
  block's halves around attention are compiled by torch.compile, whose Inductor fuses their
  element-wise ops.

It is taken for steps in which every sequence decodes one token and has all its pages in the
device pool (evicted pages need the streaming path, executor/attention.py), and whose gathered
pages stay within the pool's capacity (rounded up to a bucket): the gather buffer is then at
most twice one layer's share of the planned KV pool. On the CPU (tests) the same code runs on
the same padded shapes, without graphs (and compiled to C++ by Inductor with HELM_COMPILE=1).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.capture_gate import GATE
from executor.kv_cache import holding_unlocks
from executor.rope import inverse_frequencies
from executor.staging import PinnedStaging
from executor.torch_ops import attention_input, block_output
from planner.step_shape import bucket

# HELM_CUDA_GRAPHS=0 runs the static step eagerly on CUDA (to compare, or to rule graphs out).
GRAPHS_ENV = "HELM_CUDA_GRAPHS"
# HELM_COMPILE=1 compiles each block's halves around attention with torch.compile (off by
# default until tools/bench_gpu.py has measured it against the eager ops on a GPU).
COMPILE_ENV = "HELM_COMPILE"

# HELM_PAGED_DECODE=1 attends with executor/paged_decode.py's Triton kernels (imported only then:
# triton comes with CUDA builds of torch, and nothing else needs it)
PAGED_DECODE_ENV = "HELM_PAGED_DECODE"

log = logging.getLogger(__name__)

_POSITION, _WRITE_SLOT, _WRITE_ROW, _TABLE = 0, 1, 2, 3  # columns of the index tensor

# The capture stream of each live step, by the CUDA stream it is: weakly, so a model let go frees its.
_CAPTURE_STREAMS: "weakref.WeakValueDictionary[int, ResidentDecode]" = weakref.WeakValueDictionary()


def _capture_stream(owner: "ResidentDecode", device: torch.device) -> "torch.cuda.Stream":
    """A stream no other live step captures on. torch.cuda.Stream() hands out PyTorch's pooled
    streams in turn, and a graph replays with the cuBLAS workspace of the (handle, stream) it was
    captured on: two models' graphs captured on one stream would share scratch memory. Drawn
    until a free one comes (the pool holds 32 a device); past that many live models, the last
    drawn."""
    for _ in range(64):
        stream = torch.cuda.Stream(device)
        if stream.cuda_stream not in _CAPTURE_STREAMS:
            break
    _CAPTURE_STREAMS[stream.cuda_stream] = owner
    return stream


def ready_profiler_for_graphs() -> None:
    """For a process that will profile CUDA graphs (the CUDA tests, tools/bench_gpu.py): one empty
    profiler session before any capture. Graphs captured before the profiler's first use can fail
    to replay under it, or be missing from its trace (pytorch#75504); PyTorch's own workaround is
    this session. Nothing without CUDA."""
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]):
            pass


def _buckets(n: int) -> list[int]:
    """Every bucket up to bucket(n): 1, 2, 4, ..."""
    return [1 << i for i in range(bucket(max(1, n)).bit_length())]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor  # [rows, H] fp32, the step's input
    index: torch.Tensor  # [rows, 3 + pages] int64
    out: torch.Tensor  # [rows, H] fp32, the step's output


class ResidentDecode:
    """The decode step of a GPU stage's blocks over resident KV pages (see the module docstring).
    A stage's `fused` path: `accepts(batch)` says whether a step can take it, `(x, batch)` runs it."""

    def __init__(self, config, blocks, kv, attention, ops, graphs: bool | None = None,
                 compiled: bool | None = None):
        if kv.device_pool.slab is None:
            raise ValueError("the static decode step needs the device KV pool as a slab")
        self.config, self.blocks, self.kv, self.attention, self.ops = config, blocks, kv, attention, ops
        self.pool = kv.device_pool
        self.device = kv.device
        self.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(self.device)
        self.max_pages = bucket(max(1, self.pool.capacity_pages))  # pages gathered per step, all rows
        self.scale = config.head_dim ** -0.5
        if graphs is None:
            graphs = os.environ.get(GRAPHS_ENV, "1") != "0"
        self.graphs = graphs and self.device.type == "cuda"
        if compiled is None:
            compiled = os.environ.get(COMPILE_ENV, "0") == "1"
        self.compiled = compiled
        # A block's two halves around attention, each one region for torch.compile where asked:
        # Inductor fuses a half's element-wise ops (norms, casts, rotation, silu) into a few
        # kernels beside its GEMMs. One compile serves every layer (their weights are inputs of
        # the same shapes), and rows turn dynamic at the second row count other than 1 (which
        # PyTorch specialises): captured in the order 1, 2, 4, ..., two compiles a half.
        self._cache_dtype = self.pool.slab.dtype  # read here: read in a compiled half, it would
        # make the slab an input of the graph, guarded on its shape, so every plan a daemon loads
        # would compile again
        # compiled: a bound method, so a cycle (collected by gc, not on the last reference's drop)
        self._compiled_heads = torch.compile(self._heads_of, fullgraph=True) if compiled else None
        self._rest = torch.compile(block_output, fullgraph=True) if compiled else block_output
        self._captured: dict[tuple[int, int], _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._side = _capture_stream(self, self.device) if self.graphs else None  # warm-up and capture
        # the index tensor's copies to the device (asynchronous); on the CPU it is used as it is
        self._staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self._slots = None  # (batch, page slots per sequence) of the step `accepts` took
        # HELM_PAGED_DECODE=1: attention by executor/paged_decode.py's kernels, straight over the
        # slab's pages, instead of a gather and SDPA (opt-in until measured on a GPU)
        self.paged = False
        if os.environ.get(PAGED_DECODE_ENV, "0") == "1":
            from executor import paged_decode

            self._paged_attention = paged_decode.paged_decode_attention
            why = paged_decode.unsupported(config.head_dim, kv.page_size, config.num_heads // config.num_kv_heads,
                                           self.device) \
                or paged_decode.first_launch_error(config.num_heads, config.num_kv_heads, config.head_dim,
                                                   kv.page_size, self.pool.slab.dtype, self.device)
            if why:
                log.warning("%s=1, but the paged decode kernels cannot run here (%s): SDPA over gathered pages",
                            PAGED_DECODE_ENV, why)
            self.paged = why is None
            # the kernels split the keys for about two programs per SM (4 under the interpreter)
            self._processors = (torch.cuda.get_device_properties(self.device).multi_processor_count
                                if self.device.type == "cuda" else 4)

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(rows, pages) buckets captured."""
        return sorted(self._captured)

    def accepts(self, batch) -> bool:
        """Every sequence decodes one token (row r is sequence r) with all its pages in the slab,
        and the step's gather stays within `max_pages`. Keeps the slots for the call that follows."""
        self._slots = None
        if any(s.count != 1 or s.offset != r for r, s in enumerate(batch.slices)):
            return False
        slots = [self.kv.device_slots(s.seq_id) for s in batch.slices]
        if any(sl is None for sl in slots):
            return False
        if bucket(len(slots)) * bucket(max(len(sl) for sl in slots)) > self.max_pages:
            return False
        self._slots = (batch, slots)
        return True

    def __call__(self, x: torch.Tensor, batch) -> torch.Tensor:
        """x: [B, H] fp32 hidden of the step's B tokens (one per sequence) → [B, H] after the blocks."""
        if self._slots is None or self._slots[0] is not batch:
            raise RuntimeError("ResidentDecode called on a step it did not accept")
        slots = self._slots[1]
        rows = len(batch.slices)
        shape = (bucket(rows), bucket(max(len(sl) for sl in slots)))
        index = self._index(batch, slots, *shape)
        g = self._captured.get(shape) if self.graphs else None  # a bucket not captured at load: eager
        if g is None:
            padded = torch.zeros(shape[0], x.shape[1], dtype=x.dtype, device=x.device)
            padded[:rows] = x
            on_device = self._staging.to_device(index) if self._staging is not None else index
            return self.step(padded, on_device)[:rows]
        g.x[:rows].copy_(x)
        g.x[rows:].zero_()  # padded rows as the eager step has them
        self._staging.to_device(index, out=g.index)
        g.graph.replay()
        return g.out[:rows].clone()  # the next replay overwrites g.out

    def capture(self, max_rows: int, max_pages_per_sequence: int) -> None:
        """Capture the step's CUDA graph for every bucket a step can take: rows up to
        bucket(max_rows), pages up to bucket(max_pages_per_sequence), their product within
        `max_pages`. At load, not on first use: a capture that fails leaves the stream and the
        allocator in capture state, which no later step could recover from, so the plan's load
        fails instead (HELM_CUDA_GRAPHS=0 runs every step eagerly)."""
        if not self.graphs:
            return
        with holding_unlocks():  # host pages of pools collected meanwhile are let go after
            for rows in _buckets(max_rows):
                for pages in _buckets(max_pages_per_sequence):
                    if rows * pages <= self.max_pages and (rows, pages) not in self._captured:
                        try:
                            self._captured[(rows, pages)] = self._capture(rows, pages)
                        except Exception as e:
                            raise RuntimeError(f"CUDA graph capture of the GPU stage's decode step failed at {rows} "
                                               f"rows x {pages} pages ({e}); {GRAPHS_ENV}=0 runs it eagerly"
                                               + (f", {COMPILE_ENV}=0 without torch.compile" if self.compiled else "")
                                               ) from e

    def _index(self, batch, slots: list[list[int]], rows: int, pages: int) -> torch.Tensor:
        """[rows, 3 + pages] int64: position, write slot, row in the page, page slots (padded rows
        and pages: the scratch slot). Built as lists, one tensor at the end: per-element tensor
        writes would cost more host time than the step saves."""
        page, scratch = self.kv.page_size, self.pool.scratch_slot
        table = [[0, scratch, 0] + [scratch] * pages for _ in range(rows)]
        for r, (s, sl) in enumerate(zip(batch.slices, slots)):
            table[r][:3 + len(sl)] = [s.start, sl[s.start // page], s.start % page, *sl]
        return torch.tensor(table, dtype=torch.int64)

    def step(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The blocks on padded rows: x [rows, H] fp32 (updated in place and returned), index as
        `_index` makes it. Only device work of fixed shapes: what a CUDA graph captures. What every
        layer reads alike is made once here, so a layer launches only its own ops."""
        positions = index[:, _POSITION]
        cos, sin = self.attention.tables(self.inv_freq, positions)
        if self.paged:  # the kernels read the page table and positions as they are
            mask, table = None, index[:, _TABLE:]
        else:
            keys = (index.shape[1] - _TABLE) * self.kv.page_size
            key_pos = torch.arange(keys, device=x.device)
            # SDPA's additive mask [rows, 1, 1, keys·P]: a key is visible where its position is at or
            # before the row's (a boolean mask SDPA would convert in every layer)
            hidden = (key_pos[None, :] > positions[:, None])[:, None, None, :]
            mask = torch.zeros(hidden.shape, dtype=self._cache_dtype, device=x.device).masked_fill_(hidden, -math.inf)
            del key_pos, hidden  # not kept in the graph's pool beside the mask (planner/working_set.py)
            table = index[:, _TABLE:].reshape(-1)
        where = (index[:, _WRITE_SLOT].contiguous(), index[:, _WRITE_ROW].contiguous())
        for layer, w in enumerate(self.blocks):
            heads = (self._compiled_heads or self._heads_of)(x, w, cos, sin)
            # the attention output passed straight on: block_output frees it before the MLP
            x = self._rest(x, self._attend(layer, heads, table, where, mask, positions), w, self.ops, self.config)
        return x

    def _heads_of(self, x: torch.Tensor, w, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A block's input x [rows, H] fp32 → its q, k and v heads side by side in the cache's dtype
        [rows, H_q + 2·H_kv, D]: q/k normed and rotated, the rotation's last op writing them."""
        cfg = self.config
        h_q, h_kv = cfg.num_heads, cfg.num_kv_heads
        qkv = attention_input(x, w, self.ops, cfg)
        # q/k normed (Qwen3): the norm reads them into a tensor of its own, so the rotation can
        # write them back over qkv's own q/k, and v is where it belongs already (no copy)
        in_place = w.q_norm is not None and qkv.dtype == self._cache_dtype and qkv.is_contiguous()
        heads = qkv.view(x.shape[0], h_q + 2 * h_kv, cfg.head_dim) if in_place else \
            torch.empty(x.shape[0], h_q + 2 * h_kv, cfg.head_dim, dtype=self._cache_dtype, device=x.device)
        _, v = self.attention.project(qkv, w.q_norm, w.k_norm, cos, sin, out=heads[:, :h_q + h_kv])
        if not in_place:
            heads[:, h_q + h_kv:].copy_(v)
        return heads

    def _attend(self, layer: int, heads: torch.Tensor, table: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """heads [rows, H_q + 2·H_kv, D] (`_heads_of`) → attention output [rows, H_q·D] in the
        cache's dtype (which the o projection takes as it is on CUDA, TorchLinear.input_dtype):
        this step's K/V written into the slab, then either the paged kernels over the slab (table
        [rows, pages]) or every row's pages gathered (table flattened) and SDPA over them. SDPA's
        output reshape is a copy on CUDA (the memory-efficient kernel writes [rows, group, H_kv, D])."""
        rows, h_q, h_kv, d = heads.shape[0], self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        slab = self.pool.slab[:, layer]  # [slots, 2, H_kv, P, D]
        # K and V of each row into (its page's slot, its row in the page) of a [slots, P, 2, H_kv, D] view
        slab.permute(0, 3, 1, 2, 4).index_put_(where, heads[:, h_q:].unflatten(1, (2, h_kv)))
        if self.paged:
            return self._paged_attention(heads[:, :h_q], slab, table, positions, self.scale, self._processors)
        gathered = slab.permute(1, 2, 0, 3, 4).index_select(2, table)  # [2, H_kv, rows·pages, P, D]
        k, v = gathered.view(2, h_kv, rows, -1, d).transpose(1, 2)  # each [rows, H_kv, pages·P, D]
        # The query heads of a KV head are its rows (GQA without repeating K/V): [rows, H_kv, group, D].
        q = heads[:, :h_q].view(rows, h_kv, h_q // h_kv, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(rows, h_q * d)

    def _capture(self, rows: int, pages: int) -> _Graph:
        """The step at (rows, pages) as a CUDA graph, on static buffers whose rows all point at the
        scratch slot until a replay fills them."""
        x = torch.zeros(rows, self.config.hidden_size, device=self.device)
        index = torch.full((rows, 3 + pages), self.pool.scratch_slot, dtype=torch.int64, device=self.device)
        index[:, _POSITION] = 0
        index[:, _WRITE_ROW] = 0
        # Warm up on this thread's stream, outside the gate: compiles (torch.compile's, Triton's),
        # SDPA's kernel choice, cuBLAS's handle. Not on the capture stream: it is one of PyTorch's
        # pooled streams, which graphs of another model may have been captured on with this
        # thread's cuBLAS handle, and a graph replays with the workspace cuBLAS kept for that
        # (handle, stream): GEMMs there while those graphs replay would share their scratch memory.
        current = torch.cuda.current_stream(self.device)
        self.step(x.clone(), index)
        graph = torch.cuda.CUDAGraph()
        # the warm-up compiled what the capture runs: a compile inside it (Triton's autotuning
        # synchronises) would break the capture, so one fails at once, saying so. The stance is the
        # process's from the moment it is made: only once the gate holds other engines' steps back
        # (whose compiled steps may still need to recompile).
        with contextlib.ExitStack() as held:
            held.enter_context(GATE.capture())
            # Once no other engine's step is under way or running on the device: a step on the
            # capture stream, so its cuBLAS workspace exists before the capture records it
            torch.cuda.synchronize(self.device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                self.step(x.clone(), index)
            current.wait_stream(self._side)
            if self.compiled:
                held.enter_context(torch.compiler.set_stance("fail_on_recompile"))
            try:
                with torch.cuda.graph(graph, pool=self._mempool, stream=self._side,
                                      capture_error_mode="thread_local"):
                    out = self.step(x, index)
            except BaseException:
                # torch.cuda.graph's exit leaves the capture stream current on this thread where
                # ending the capture raises: a later load on this thread (a gRPC worker's) would
                # queue its work there
                torch.cuda.set_stream(current)
                raise
        return _Graph(graph, x, index, out)
