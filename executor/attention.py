"""Streaming attention over KV pages (online softmax).

The KV of a sequence lives in fixed-size pages, some resident on the compute device and some
evicted to host memory. Rather than gathering them into one tensor, attention visits the pages
one at a time and keeps, per query row, a running max score `m`, running sum of exponentials
`s` and running weighted value sum `o`; when a page raises the max, `s` and `o` are rescaled by
exp(m_old - m_new). The result o / s equals softmax attention over all pages exactly (up to
float rounding), and only one page at a time needs to be on the device.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from executor.rope import apply_rotary, rotation_tables
from planner.profile import flash_attention_runs

if TYPE_CHECKING:
    from executor.batch import StepBatch
    from executor.kv_cache import KVCache, KVChunk
    from executor.model_config import ModelConfig

log = logging.getLogger(__name__)


def streaming_attention(
    q: torch.Tensor,
    chunks: Iterable[KVChunk],
    scale: float,
    q_positions: torch.Tensor | None = None,
    first_query: int | None = None,
) -> torch.Tensor:
    """Attention of q over KV chunks visited in order.

    q: [T, H_q, D] (any float dtype; math in fp32). Query heads are grouped over KV heads as in
    GQA: query head h reads KV head h // (H_q / H_kv).
    q_positions: [T] absolute positions of the queries for causal masking (a key at position p
    is visible to a query at position >= p); None means every key is visible. first_query: the
    earliest of those positions, known on the host, so chunks wholly before it skip the mask
    without asking the device (None: every chunk is masked).
    Returns [T, H_q, D] fp32.
    """
    T, h_q, _ = q.shape
    chunks = iter(chunks)
    first = next(chunks, None)
    if first is None:
        raise ValueError("attention over an empty KV sequence")
    second = next(chunks, None)
    if second is None:  # the whole sequence is one page: plain softmax, fewer ops
        return _one_chunk(q, first, scale, q_positions, first_query)
    h_kv = first[0].shape[0]
    group = h_q // h_kv
    qg = _grouped(q, h_kv)  # [H_kv, group*T, D]
    m = s = o = None
    pages = _in_order([first, second], chunks)  # not holding the first two pages to the end
    del first, second
    # A page's fp32 scores per query head are the largest temporaries (planner/working_set.py
    # prices one at a time): made once and updated in place, not copied per operation.
    for k, v, start in pages:
        scores = torch.matmul(qg, k.float().transpose(1, 2)).mul_(scale)  # [H_kv, group*T, n]
        scores = _mask_future(scores, q_positions, start, group, first_query)
        chunk_max = scores.amax(dim=-1, keepdim=True)  # [H_kv, group*T, 1]
        if m is None:
            m_new = chunk_max
        else:
            m_new = torch.maximum(m, chunk_max)
        # A row with every key masked so far has m_new = -inf; use 0 there so exp() gives 0, not NaN.
        safe_m = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = scores.sub_(safe_m).exp_()
        pv = torch.matmul(p, v.float())  # [H_kv, group*T, D]
        if m is None:
            s, o = p.sum(dim=-1, keepdim=True), pv
        else:
            correction = torch.exp(m - safe_m)
            s.mul_(correction).add_(p.sum(dim=-1, keepdim=True))
            o.mul_(correction).add_(pv)
        m = m_new
        del scores, p, pv, k, v  # this page's copy can go before the next one comes
    return _ungrouped(o / s, T, h_q)


def _in_order(head: list, rest: Iterator) -> Iterator:
    """The items of `head`, then of `rest`, each let go once it is handed out."""
    while head:
        yield head.pop(0)
    yield from rest


def _grouped(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """[T, H_q, D] → [H_kv, group*T, D]: row g*T + t is query t of head kv*group + g."""
    T, h_q, d = q.shape
    return q.float().permute(1, 0, 2).reshape(h_kv, (h_q // h_kv) * T, d)


def _ungrouped(out: torch.Tensor, T: int, h_q: int) -> torch.Tensor:
    """[H_kv, group*T, D] → [T, H_q, D]."""
    return out.reshape(h_q, T, out.shape[-1]).permute(1, 0, 2)


def _mask_future(scores: torch.Tensor, q_positions: torch.Tensor | None, start: int, group: int,
                 first_query: int | None) -> torch.Tensor:
    """-inf, in place, where a key (at start + column) lies after the query's position. Decided on
    the host (no device sync): a chunk whose last key is at or before the first query needs no mask."""
    n = scores.shape[-1]
    if q_positions is None or (first_query is not None and start + n - 1 <= first_query):
        return scores
    key_pos = torch.arange(start, start + n, device=q_positions.device)
    hidden = key_pos[None, :] > q_positions[:, None]  # [T, n]
    return scores.masked_fill_(hidden.repeat(group, 1)[None], float("-inf"))


def _one_chunk(q: torch.Tensor, chunk: KVChunk, scale: float, q_positions: torch.Tensor | None,
               first_query: int | None = None) -> torch.Tensor:
    k, v, start = chunk
    T, h_q, _ = q.shape
    group = h_q // k.shape[0]
    scores = torch.matmul(_grouped(q, k.shape[0]), k.float().transpose(1, 2)).mul_(scale)  # [H_kv, group*T, n]
    scores = _mask_future(scores, q_positions, start, group, first_query)
    # softmax in place: one page of scores per query head at a time, as streaming_attention
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    probs = scores.div_(scores.sum(dim=-1, keepdim=True))
    return _ungrouped(torch.matmul(probs, v.float()), T, h_q)


def without_cudnn_attention() -> None:
    """Our SDPA calls on CUDA take flash attention (prompt chunks) or memory-efficient attention
    (the decode graphs' masked step, executor/device_step.py), math as the last resort, not
    cuDNN's: PyTorch prefers cuDNN on Hopper for half precision, where it raises rather than falls
    back on shapes it has no plan for (gathered K/V, a lower-right causal chunk), and every decode
    graph bucket would build a plan of its own at load. Process-wide: the flag is global, so a
    context per call would cost host time in every layer and race other threads. Set by every
    TorchAttention on a CUDA KV cache (every SDPA call of ours is one's)."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        log.info("SDPA on CUDA: cuDNN attention off (flash, memory-efficient or math)")
        torch.backends.cuda.enable_cudnn_sdp(False)


def prompt_attention_dtype(kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype PyTorch's fused attention computes a prompt chunk in, for a KV cache of kv_dtype:
    on CUDA the cache's (its flash kernels are half-precision kernels); on the CPU bf16 for a
    bf16 cache (as transformers computes a bf16 model's attention; its CPU kernel has bf16
    paths), fp32 otherwise (its fp16 path is slower than fp32 on CPUs without native fp16)."""
    if device.type == "cuda":
        return kv_dtype
    return torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32


def fused_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, num_heads: int,
                           scale: float) -> torch.Tensor:
    """Causal attention of queries q [n, H_q·D] fp32 at positions start.. over k, v [H_kv, start + n, D]
    (the sequence's cached keys, this chunk's included) through PyTorch's fused attention (on the
    CPU a blocked-GEMM flash kernel; on CUDA flash attention: TorchAttention takes this path there
    only where planner.profile.flash_attention_runs says it runs) in prompt_attention_dtype; returns
    [n, H_q·D] in that dtype. The prompt path of the CPU kernels' stage and of the GPU stage, and
    the profile's probe of it (executor/probe.py)."""
    n, head_dim = q.shape[0], k.shape[-1]
    dtype = prompt_attention_dtype(k.dtype, k.device)
    qh = q.view(n, num_heads, head_dim).transpose(0, 1).to(dtype)  # [H_q, n, D]
    k, v = k.to(dtype), v.to(dtype)
    group = num_heads // k.shape[0]
    if k.device.type == "cuda":
        o = lower_right_causal_attention(qh, k, v, scale)
    else:
        # the CPU's flash kernel takes the mask (booleans, chunk × context: priced in host memory)
        # and GQA as they are
        mask = None if start == 0 else \
            torch.arange(start + n, device=k.device)[None, :] <= torch.arange(start, start + n, device=k.device)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qh[None], k[None], v[None], attn_mask=mask, is_causal=start == 0, scale=scale, enable_gqa=group > 1)[0]
    return o.transpose(0, 1).reshape(n, num_heads * head_dim)


def flash_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H_q, n, D] over k, v [H_kv, L, D] (query head h reading KV head h // (H_q / H_kv)), all
    keys visible or, causal, a square block's (L = n) → (output [H_q, n, D] in q's dtype,
    log-sum-exp [H_q, n] fp32 of the scaled scores): PyTorch's flash attention, which returns
    the log-sum-exp beside its output (on CUDA in half precision; on the CPU its blocked-GEMM
    kernel, which the tests run)."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q[None], k[None], v[None], 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, scale=scale)
    return out[0], lse[0, :, :q.shape[1]]  # (a kernel may pad the queries' log-sum-exps)


def _merged(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
            lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over two disjoint sets of keys from each set's (output, log-sum-exp):
    each output weighted by its share of the exponentials, in fp32."""
    if acc is None:
        return out.float(), lse
    o, m = acc
    both = torch.logaddexp(m, lse)
    return o.mul_(torch.exp(m - both)[..., None]).add_(out.float().mul_(torch.exp(lse - both)[..., None])), both


def segmented_prompt_attention(q: torch.Tensor, cached: Iterable[KVChunk], own_k: torch.Tensor,
                               own_v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of a prompt chunk's queries q [n, H_q, D] at positions start.. over the
    sequence's cached keys (`cached`: its pages' K/V [H_kv, m, D] and first positions, covering
    positions < start, oldest first) and its own, own_k / own_v [n, H_kv, D]: flash attention a
    page at a time, no page's keys masked (all precede the chunk: a KV head's query heads go in
    as rows of one head, so GQA needs no copies), then the chunk's own keys as one square causal
    block, the outputs merged by their log-sum-exps. For a sequence longer than the device pool
    holds (its parked pages come in one at a time, as `cached` brings them): the K/V of one page
    at a time on the device, as streaming attention holds, at flash attention's speed rather than
    fp32 operations' (planner/working_set.py prices it). → [n, H_q·D] in the prompt attention
    dtype of the cache's."""
    n, h_q, d = q.shape
    h_kv = own_k.shape[1]
    group = h_q // h_kv
    dtype = prompt_attention_dtype(own_k.dtype, own_k.device)
    rows = q.to(dtype).permute(1, 0, 2)                                  # [H_q, n, D]
    grouped = rows.reshape(h_kv, group * n, d)                           # row g·n + t: query t of head kv·group + g
    acc = None
    for k, v, first in cached:
        m = min(k.shape[1], start - first)
        if m > 0:
            acc = _merged(acc, *flash_segment(grouped, k[:, :m].to(dtype), v[:, :m].to(dtype), scale, False))
        del k, v
    if acc is not None:  # [H_kv, group·n, ...] → [H_q, n, ...]
        acc = acc[0].reshape(h_q, n, d), acc[1].reshape(h_q, n)
    # [H_kv, n, D]: the flash operators read query head h's keys from KV head h // group themselves
    own = own_k.to(dtype).transpose(0, 1), own_v.to(dtype).transpose(0, 1)
    o, _ = _merged(acc, *flash_segment(rows, *own, scale, True))
    return o.transpose(0, 1).reshape(n, h_q * d).to(dtype)


_SEGMENTED_CHECKED: dict[tuple, str | None] = {}  # segmented_attention_error's answers, per shape


def segmented_attention_error(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                              head_dim: int) -> str | None:
    """Why segmented_prompt_attention cannot serve this stage (None: it can): run on random K/V of
    two pages and a chunk, against fp32 attention with the mask made, once a shape (answers kept;
    not running out of memory, which a later load may not). Its flash kernel is one of PyTorch's
    own operators (the one its scaled_dot_product_attention dispatches to), not its public API:
    a build whose operator differs says so here, at load, and the stage streams."""
    key = (torch.device(device), dtype, num_heads, num_kv_heads, head_dim)
    if key not in _SEGMENTED_CHECKED:
        why = _segmented_check(key[0], dtype, num_heads, num_kv_heads, head_dim)
        if why is not None and why.startswith("OutOfMemoryError"):
            return why
        _SEGMENTED_CHECKED[key] = why
    return _SEGMENTED_CHECKED[key]


def _segmented_check(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> str | None:
    g = torch.Generator(device=device).manual_seed(0)
    start, n, page = 96, 40, 64
    try:
        k, v = (torch.randn(num_kv_heads, start + n, head_dim, generator=g, device=device).to(dtype) for _ in range(2))
        q = torch.randn(n, num_heads, head_dim, generator=g, device=device)
        pages = [(k[:, a:a + page], v[:, a:a + page], a) for a in range(0, start, page)]
        got = segmented_prompt_attention(q, pages, k[:, start:].transpose(0, 1), v[:, start:].transpose(0, 1),
                                         start, head_dim ** -0.5).float()
        group = num_heads // num_kv_heads
        visible = torch.arange(start + n, device=device)[None, :] <= torch.arange(start, start + n, device=device)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.float().repeat_interleave(group, 0)[None],
            v.float().repeat_interleave(group, 0)[None], attn_mask=visible, scale=head_dim ** -0.5)[0]
        err = (got - want.transpose(0, 1).reshape(n, -1)).abs().max().item()
    except Exception as e:  # noqa: BLE001 — any failure means: not here
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    bound = 1e-4 if dtype == torch.float32 else 5e-2  # random unit-scale values: a half's rounding, not a fault
    return None if err <= bound else f"its output is {err:.3g} from fp32 attention's (more than {bound:g})"


def lower_right_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H_q, n, D] attending causally over k, v [H_kv, L, D] whose last n keys are the queries'
    own (query t sees keys <= L - n + t), query head h reading KV head h // (H_q / H_kv) → [H_q, n, D].
    On CUDA flash attention runs it with no mask made (its causal flag aligns to the lower right
    and it reads GQA as it is), so a chunk late in a long prompt costs its gathered K/V and
    nothing that grows with chunk × context (planner/working_set.py); elsewhere PyTorch
    materialises the mask."""
    from torch.nn.attention.bias import causal_lower_right

    h_q, n, _ = q.shape
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=causal_lower_right(n, k.shape[1]), scale=scale,
        enable_gqa=h_q != k.shape[0])[0]


class TorchAttention:
    """A stage's self-attention in plain PyTorch (the reference path, and the one CUDA stages use):
    q/k RMSNorm, rotary embedding, K/V appended to the paged cache, streaming attention per
    sequence. fused_prompt: a prompt chunk (more than one query) of a sequence the device pool
    could hold whole (KVCache.gathers) gathers its pages and takes PyTorch's fused attention
    (`fused_prompt_attention`) instead of streaming: the GPU stage's prompt path (its decode
    steps take executor/device_step.py where they can); on CUDA only where flash attention runs
    it."""

    def __init__(self, config: "ModelConfig", kv: "KVCache", ops, fused_prompt: bool = False):
        self.config, self.kv, self.ops = config, kv, ops
        self.scale = config.head_dim ** -0.5
        if kv is not None and kv.device.type == "cuda":
            # here, not where a stage is loaded: the profile's decode-block probe builds its stages itself
            without_cudnn_attention()
        if fused_prompt and kv.device.type == "cuda" and not flash_attention_runs(
                kv.device, kv.dtype, config.num_heads, config.num_kv_heads, config.head_dim):
            # any other fused kernel on CUDA would need a chunk × context mask (or K/V repeated
            # per query head): streaming needs neither, and is what a plan prices where its
            # profile does not say flash attention runs (planner/working_set.py)
            log.warning("no flash attention for a %s KV cache on %s: the GPU stage's prompt chunks stream "
                        "over their pages (a plan whose profile says flash attention runs priced less VRAM "
                        "for them)", str(kv.dtype).removeprefix("torch."), torch.cuda.get_device_name(kv.device))
            fused_prompt = False
        self.fused_prompt = fused_prompt
        # a sequence longer than the device pool (fused_prompt, not gathered): flash attention a
        # page at a time, where its operator gives attention's values here (else it streams)
        self.segmented = fused_prompt and kv is not None
        if self.segmented and kv.device.type == "cuda":
            why = segmented_attention_error(kv.device, kv.dtype, config.num_heads, config.num_kv_heads,
                                            config.head_dim)
            if why is not None:
                log.warning("flash attention a page at a time cannot run here (%s): prompt chunks of sequences "
                            "longer than the device pool stream over their pages (a plan whose profile says "
                            "flash attention runs priced less VRAM for them)", why)
                self.segmented = False

    @staticmethod
    def tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables a step's layers share, as `project` takes them."""
        return rotation_tables(inv_freq, positions)

    def project(self, qkv: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv: [T, (H_q + 2·H_kv)·D], fp32 or (a GPU stage's) in the weights' half precision →
        qk [T, H_q + H_kv, D] fp32 (the query heads, then the key heads: RMSNorm where the model
        has it, then the rotary embedding; in `out` where given, of any float dtype) and v
        [T, H_kv, D] (a view of qkv). Queries and keys go through each op together: on the GPU a
        decode step is bound by how many ops it launches."""
        cfg = self.config
        T, h_q, h_kv = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads
        heads = qkv.view(T, h_q + 2 * h_kv, cfg.head_dim)
        v = heads[:, h_q + h_kv:]
        qk = heads[:, :h_q + h_kv]
        if q_norm is not None:
            # normed in fp32, from a contiguous input (the fused kernel would first copy a strided
            # one): a half-precision qkv's q/k widened into a copy of their own; an fp32 qkv
            # normed whole, v's heads too (unused), rather than copied
            normed = self.ops.rms_norm(heads if heads.dtype == torch.float32 else qk.float(), None,
                                       cfg.rms_norm_eps)
            normed[:, :h_q].mul_(q_norm)
            normed[:, h_q:h_q + h_kv].mul_(k_norm)
            qk = normed[:, :h_q + h_kv]
        return apply_rotary(qk, cos, sin, out), v

    def __call__(self, qkv: torch.Tensor, q_norm, k_norm, layer: int, batch: "StepBatch",
                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qkv: [T, (H_q + 2·H_kv)·D] (as `project` takes it) → attention output [T, H_q·D] fp32;
        cos, sin from `tables`."""
        cfg = self.config
        T = qkv.shape[0]
        qk, v = self.project(qkv, q_norm, k_norm, cos, sin)
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        out = torch.empty(T, cfg.num_heads, cfg.head_dim, device=qk.device)
        for s in batch.slices:
            rows = slice(s.offset, s.offset + s.count)
            self.kv.write(layer, s.seq_id, s.start, k[rows], v[rows])
            end = s.start + s.count
            if self.fused_prompt and s.count > 1 and self.kv.gathers(s.seq_id, end):
                # Gathered where the plan priced it: every page on the device, or no longer than
                # the device pool (pages parked meanwhile come back into the gather); a longer
                # sequence with pages on the host takes flash attention a page at a time below.
                # Not bound to names: the next sequence's gather must not find this one still alive.
                out[rows] = fused_prompt_attention(q[rows].reshape(s.count, cfg.q_dim),
                                                   *self.kv.gathered(layer, s.seq_id, end), s.start,
                                                   cfg.num_heads, self.scale).view(s.count, cfg.num_heads, -1)
                continue
            if self.segmented and s.count > 1:
                # its cached pages (parked ones copied in a page at a time), then its own keys in
                # the cache's dtype, as its pages hold them for the chunks and decodes after it
                cached = self.kv.chunks(layer, s.seq_id, s.start) if s.start else ()
                out[rows] = segmented_prompt_attention(
                    q[rows], cached, k[rows].to(self.kv.dtype), v[rows].to(self.kv.dtype), s.start,
                    self.scale).view(s.count, cfg.num_heads, -1)
                continue
            # Decode (one query at the newest position) needs no mask: every cached key is visible.
            q_pos = positions[rows] if s.count > 1 else None
            out[rows] = streaming_attention(q[rows], self.kv.chunks(layer, s.seq_id, end), self.scale, q_pos,
                                            first_query=s.start)
        return out.reshape(T, cfg.q_dim)
