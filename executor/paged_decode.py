"""Decode attention straight over the slab's KV pages, split across the GPU (a Triton kernel pair).

Why: the GPU stage's static decode step (executor/device_step.py) gathers each row's pages into
one buffer and runs SDPA over it. At batch 1 PyTorch's masked attention (memory-efficient
attention) gives each KV head one thread block, so 8 blocks of a 132-SM GPU read the whole
context one key block after another, and the gather reads and writes that KV once more before.
These kernels read each page where it lies in the slab, through the page table, and split the
keys among many blocks (flash-decoding):

- `_attend_split`: program (row, KV head, split) attends the query heads of that KV head to the
  split's keys (an online softmax over blocks of BLOCK_N keys within one page each; a key is
  visible where its position is at or before the row's, so the last page's later slots, padded
  pages and padded rows, which point at the scratch slot, are hidden by the same test as SDPA's
  mask) and writes its partial output and log-sum-exp;
- `_combine`: program (row, query head) weighs the splits by their log-sum-exp and writes the
  attention output in the cache's dtype, [rows, H_q·D] as the o projection takes it (no copy).

Two launches a layer in place of the gather, SDPA and the output's copy. Opt-in (HELM_PAGED_DECODE=1,
executor/device_step.py) until tools/bench_gpu.py has measured it against SDPA on a GPU. In tests
it runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1). fp16 blocks multiply there as
on the GPU, so the tests cover the half-precision path; the interpreter keeps bf16 as 16-bit
integers for NumPy, whose products of them are wrong, so there bf16 blocks are widened to fp32
first (`UPCAST`). An fp32 cache is multiplied in IEEE fp32 everywhere (no TF32), as the SDPA path
does.
"""
import contextlib
import functools
import math
import os

import torch

MIN_BLOCK = 16  # tl.dot's smallest side: query heads are padded to it, a page must hold it
MAX_BLOCK_N = 64  # keys per inner block
# Elements of a K (or V) block a program holds at once: compiled for sm_90, a block of 64 keys at
# D = 128 in fp32 (the widened path) took all 255 registers and spilled; these budgets do not
BLOCK_ELEMENTS = {"half": 64 * 128, "fp32": 16 * 128}

try:
    import triton
    import triton.language as tl
except Exception as e:  # noqa: BLE001 — not installed (CPU builds of torch), or a broken install
    triton = tl = None
    _NO_TRITON = f"Triton cannot be imported ({type(e).__name__}: {e})"


def unsupported(head_dim: int, page_size: int, group: int, device: torch.device) -> str | None:
    """Why these kernels cannot run this stage's decode attention (None: they can, as far as the
    shapes and the device say; `first_launch_error` tries them)."""
    if triton is None:
        return _NO_TRITON
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "a GPU before compute capability 8.0 (no bf16 tensor-core products)"
    elif not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"a {device.type} device (CUDA, or the CPU under Triton's interpreter, TRITON_INTERPRET=1)"
    if head_dim < MIN_BLOCK or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two from {MIN_BLOCK} to 256"
    if page_size < MIN_BLOCK or page_size & (page_size - 1):
        return f"the KV page of {page_size} tokens is not a power of two of at least {MIN_BLOCK}"
    if group > 64:
        return f"{group} query heads per KV head (at most 64)"
    return None


def first_launch_error(q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                       device: torch.device) -> str | None:
    """Run the kernels once on one page of zeros at the stage's shapes and dtype (every compile-time
    choice but the split count's padding, which changes no resource): a GPU whose shared memory or
    Triton build cannot take them says so here, at load, rather than in a graph capture. None: they ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an earlier asynchronous error is raised here, as itself
    try:
        slab = torch.zeros(2, 2, kv_heads, page_size, head_dim, dtype=dtype, device=device)
        q = torch.zeros(1, q_heads, head_dim, dtype=dtype, device=device)
        index = torch.tensor([[0, 0]], dtype=torch.int64, device=device)  # position 0, page slot 0
        paged_decode_attention(q, slab, index[:, 1:], index[:, 0], head_dim ** -0.5, 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 — any failure means: not here
        # Triton's compile errors start with the source position: their last line says what failed
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    return None


def splits_for(rows: int, kv_heads: int, keys: int, processors: int) -> tuple[int, int]:
    """(keys per split, splits): enough programs for about two per streaming processor, each over
    whole blocks of min(MAX_BLOCK_N, keys) keys (a multiple of the kernel's block, `block_n`: a
    power of two no larger, since a row's keys are whole pages)."""
    block = min(MAX_BLOCK_N, keys)
    blocks = -(-keys // block)
    want = max(1, min(blocks, -(-2 * processors // max(1, rows * kv_heads))))
    per_split = -(-blocks // want) * block
    return per_split, -(-keys // per_split)


def block_n(page: int, head_dim: int, fp32_blocks: bool) -> int:
    """Keys per inner block: as many as the register budget for the blocks' width allows, from
    MIN_BLOCK to min(MAX_BLOCK_N, page) (powers of two, so a block never spans two pages and
    divides a split's keys)."""
    budget = BLOCK_ELEMENTS["fp32" if fp32_blocks else "half"] // head_dim
    return max(MIN_BLOCK, min(MAX_BLOCK_N, page, triton.next_power_of_2(budget + 1) // 2))


def paged_decode_attention(q: torch.Tensor, slab_layer: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
                           scale: float, processors: int) -> torch.Tensor:
    """q [rows, H_q, D] (each row's one query, any strides but a contiguous last dim) attends over
    the pages table [rows, pages] names in slab_layer [slots, 2, H_kv, P, D] (K, V), keys at or
    before positions [rows] visible → [rows, H_q·D] in the slab's dtype. Only device work of
    fixed shapes (a CUDA graph captures it)."""
    rows, h_q, d = q.shape
    _, _, h_kv, page, _ = slab_layer.shape
    group = h_q // h_kv
    if q.stride(-1) != 1 or slab_layer.stride(-1) != 1:
        raise ValueError("the paged decode kernels read head vectors whole: their last dimension must be contiguous")
    keys = table.shape[1] * page
    per_split, splits = splits_for(rows, h_kv, keys, processors)
    group_pad = max(MIN_BLOCK, triton.next_power_of_2(group))
    partial = torch.empty(rows, h_kv, splits, group_pad, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, h_kv, splits, group_pad, dtype=torch.float32, device=q.device)
    upcast = slab_layer.dtype == torch.float32 or (q.device.type != "cuda" and slab_layer.dtype == torch.bfloat16)
    attend_split, combine = _kernels()
    out = torch.empty(rows, h_q * d, dtype=slab_layer.dtype, device=q.device)
    # Triton launches on the current CUDA device: make it the tensors' (a no-op for "cuda", index None)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        attend_split[(rows, h_kv, splits)](
            q, slab_layer, table, positions, partial, lse, scale * math.log2(math.e),
            q.stride(0), q.stride(1), *slab_layer.stride()[:4], table.stride(0), positions.stride(0), per_split,
            PAGE=page, GROUP=group, GROUP_PAD=group_pad, D=d, BLOCK_N=block_n(page, d, upcast), UPCAST=upcast)
        combine[(rows, h_q)](partial, lse, out, splits, GROUP=group, GROUP_PAD=group_pad, D=d,
                             SPLITS_PAD=triton.next_power_of_2(splits))
    return out


@functools.cache
def _kernels():
    """The two kernels, made by triton.jit on first use (under the interpreter where TRITON_INTERPRET=1
    was set before triton was first imported: tests/conftest.py)."""
    return triton.jit(_attend_split), triton.jit(_combine)


if triton is not None:
    def _attend_split(q_ptr, slab_ptr, table_ptr, pos_ptr, partial_ptr, lse_ptr, scale_log2,
                      stride_q_row, stride_q_head, stride_slot, stride_kv, stride_head, stride_token, stride_table,
                      stride_pos, keys_per_split,
                      PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
        # keys_per_split a runtime argument: one compile serves every graph bucket of a stage
        row = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK_N)
        q = tl.load(q_ptr + row * stride_q_row + (head * GROUP + g)[:, None] * stride_q_head + d[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        position = tl.load(pos_ptr + row * stride_pos)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores (log2 units)
        s = tl.zeros([GROUP_PAD], tl.float32)  # running sum of their exponentials
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        first = split * keys_per_split
        for start in range(first, first + keys_per_split, BLOCK_N):
            if start <= position:  # blocks wholly after the row's position are skipped, not masked
                slot = tl.load(table_ptr + row * stride_table + start // PAGE)
                at = (slab_ptr + slot * stride_slot + head * stride_head
                      + ((start % PAGE) + n)[:, None] * stride_token + d[None, :])
                visible = start + n <= position
                # masked slots read as 0: a page's later slots may hold what an earlier sequence wrote
                k = tl.load(at, mask=visible[:, None], other=0.0)  # [BLOCK_N, D]
                v = tl.load(at + stride_kv, mask=visible[:, None], other=0.0)
                if UPCAST:
                    scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    scores = tl.dot(q, tl.trans(k))
                scores = tl.where(visible[None, :], scores * scale_log2, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, 1))
                p = tl.exp2(scores - m_new[:, None])
                correction = tl.exp2(m - m_new)
                s = s * correction + tl.sum(p, 1)
                if UPCAST:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * correction[:, None] + pv
                m = m_new
        # a split wholly after the position keeps s = 0: log-sum-exp -inf, weight 0 in _combine
        out = (((row * tl.num_programs(1) + head) * tl.num_programs(2)) + split) * GROUP_PAD + g
        tl.store(partial_ptr + out[:, None] * D + d[None, :], acc / tl.where(s > 0, s, 1.0)[:, None])
        tl.store(lse_ptr + out, tl.where(s > 0, m + tl.log2(tl.where(s > 0, s, 1.0)), float("-inf")))

    def _combine(partial_ptr, lse_ptr, out_ptr, splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 D: tl.constexpr, SPLITS_PAD: tl.constexpr):
        row = tl.program_id(0)
        q_head = tl.program_id(1)
        heads = tl.num_programs(1)
        kv_head = q_head // GROUP
        g = q_head % GROUP
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, D)
        at = ((row * (heads // GROUP) + kv_head) * splits + sp) * GROUP_PAD + g  # [SPLITS_PAD]
        lse = tl.load(lse_ptr + at, mask=sp < splits, other=float("-inf"))
        weight = tl.exp2(lse - tl.max(lse, 0))  # the first split always holds key 0: the max is finite
        part = tl.load(partial_ptr + at[:, None] * D + d[None, :], mask=(sp < splits)[:, None], other=0.0)
        o = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + (row * heads + q_head) * D + d, o.to(out_ptr.dtype.element_ty))
