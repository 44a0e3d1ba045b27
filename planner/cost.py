"""Roofline cost model for one decode step, and the memory each split needs (DESIGN §5).

For k units on the CPU (units 0..k-1) and the rest on the GPU:

    T_plan(k) = T_cpu(units < k) + T_gpu(units >= k) + T_comm
    T_stage   = Σ_units (T_proj + T_attn) + n_blocks · δ_device
    T_proj    = max(F_proj / (P·η_c), W_param / (M·η_m))
    T_attn    = max(F_attn / (P·η_c), W_kv / (M̂·η_m·η_kv))
    M̂         = α·B_L3 + (1−α)·M,  α = min(1, C_L3 / W_step)  (CPU; the GPU reads KV at HBM speed)
    T_comm    = ℓ_h2d + W_act / B_h2d                        (0 for a single-device plan)

F and W come from the traced IR (planner/trace.py), M, P, C_L3, B_L3, ℓ and B from the machine
profile, η and δ from the calibration. Where the profile measured the executor's CPU kernels for
the model's weight dtype (`cpu.kernels`), the CPU's weights stream at the GEMV's measured rate
(M_w in T_proj), a prompt chunk's projections run at the measured rate of a decoder block on a
chunk of that size (P(n): the chosen GEMM path with the element-wise work around it) and prompt
attention at its own measured rate: the kernels that will run, not a generic fp32 GEMM. Two additions DESIGN §5 leaves open, both documented in
the plan: with KV offload, pages parked on the host are streamed back over the link every step
(added to the GPU's KV read time); TTFT is the same roofline for a prefill of the prompt, where
the output projection computes logits for the last position only and the attention FLOPs (of a
chunk over its cached prefix, for the executor's chunked prefill) run at P·η_c·η_attn: a fused
attention kernel and the projections' GEMMs run at different rates (recalibration fits both).

One departure from DESIGN §5, where α = min(1, C_L3 / W_kv) with W_kv one block's KV: a block's
KV is read again only one step later, after every other weight and KV byte of the stage has
streamed through the cache, so what can stay in L3 is set by W_step, the bytes the whole stage
reads per step. On a machine whose L3 holds a block's KV but not a stage's weights, decode steps
grow with context as if the KV came from DRAM, while the per-block rule prices it at L3 speed
(tools/bench_prediction.py shows the error per context length).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from planner.machine import DeviceCalibration, GpuProfile, MachineProfile
from planner.ir import SharedWeight, UnitIR
from planner.step_shape import (MAX_STEP_TOKENS, PREFILL_CHUNK_TOKENS, STREAM_PIECE_BYTES, STREAM_SLOTS,
                                STREAMED_STEP_TOKENS, longest_gather, pieces, prompt_steps, step_tokens, streams,
                                sub_steps)
from planner.units import GIB, fmt_bytes
from planner.working_set import STREAM_ROWS_GRAIN, cpu_working_bytes, gpu_working_bytes, streamed_step_bytes

MIN_DEVICE_PAGES_WITH_OFFLOAD = 2  # the page being written + one page streamed back


@dataclass(frozen=True)
class DeviceRates:
    """What a stage's cost needs to know about its device."""
    device: str                 # "cpu" | "cuda"
    mem_gibps: float            # M: DRAM (CPU) or HBM (GPU) read bandwidth (KV reads)
    decode_gflops: float        # P_dec
    prefill_gflops: float       # P for prefill (GEMM-shaped work)
    cache_bytes: int            # C_L3 (0 on the GPU)
    cache_gibps: float          # B_L3
    calibration: DeviceCalibration
    weight_gibps: float = 0.0   # rate at which the projections stream their weights (0: mem_gibps)
    attn_gflops: float = 0.0    # prompt attention's FLOP rate before η_attn (0: prefill_gflops)
    prefill_rate: Callable[[float], float] | None = None  # P for a chunk of n tokens (None: prefill_gflops)

    def prefill_gflops_at(self, rows: float) -> float:
        return self.prefill_rate(rows) if self.prefill_rate is not None else self.prefill_gflops


def device_rates(machine: MachineProfile, device: str, calibration=None, dtype: str | None = None) -> DeviceRates:
    """A device's rates for a model whose weights are `dtype` (float32 | bfloat16 | float16): on
    a CPU whose profile measured the executor's kernels for that dtype, the rates of the kernels
    that will run (the GEMV's weight streaming, the chosen prompt-GEMM path, prompt attention);
    otherwise the generic DRAM read and fp32 GEMM figures. On the GPU, gpu_rates."""
    calibration = calibration or machine.calibration
    if device == "cpu":
        c = machine.cpu
        k = c.kernels.for_dtype(dtype) if c.kernels is not None else None
        if k is None:
            return DeviceRates("cpu", c.dram_read_gibps, c.compute_gflops, c.compute_gflops, c.l3_bytes,
                               c.l3_read_gibps, calibration.cpu)
        return DeviceRates("cpu", c.dram_read_gibps, k.gemm_gflops, k.prompt_gflops_at(PREFILL_CHUNK_TOKENS),
                           c.l3_bytes, c.l3_read_gibps, calibration.cpu, weight_gibps=k.gemv_gibps,
                           attn_gflops=k.attention_gflops, prefill_rate=k.prompt_gflops_at)
    if machine.gpu is None:
        raise ValueError("machine profile has no GPU")
    return gpu_rates(machine.gpu, calibration.cuda)


def gpu_rates(g: GpuProfile, calibration: DeviceCalibration) -> DeviceRates:
    """The GPU's rates: weights read at the rate the profile's one-token matmul reached where it
    has one, else HBM's; KV at HBM's; no cache the cost model blends in."""
    return DeviceRates("cuda", g.hbm_gibps, g.prefill_gflops, g.prefill_gflops, 0, g.hbm_gibps, calibration,
                       weight_gibps=g.gemv_gibps or 0.0)


def _ms(flops: float, gflops: float, nbytes: float, gibps: float, cal: DeviceCalibration) -> float:
    """Roofline: the slower of compute and memory, in milliseconds."""
    compute = flops / (gflops * 1e9 * cal.eta_compute) if flops else 0.0
    memory = nbytes / (gibps * GIB * cal.eta_memory) if nbytes else 0.0
    return 1e3 * max(compute, memory)


def kv_read_gibps(rates: DeviceRates, step_bytes: float) -> float:
    """M̂: the L3-blended bandwidth of KV reads on a stage that streams `step_bytes` (weights + KV)
    per step: the fraction of its reads the cache can hold from one step to the next."""
    if rates.cache_bytes <= 0 or step_bytes <= 0:
        return rates.mem_gibps
    alpha = min(1.0, rates.cache_bytes / step_bytes)
    return alpha * rates.cache_gibps + (1 - alpha) * rates.mem_gibps


def weight_read_bytes(unit: UnitIR, tokens: int) -> int:
    """Weight bytes a unit reads for `tokens` tokens in one step (gather units read rows)."""
    if unit.read_bytes_per_token >= unit.weight_bytes:
        return unit.weight_bytes
    return min(unit.weight_bytes, unit.read_bytes_per_token * tokens)


def unit_decode_ms(unit: UnitIR, rates: DeviceRates, batch: int, context: int,
                   streamed_kv_fraction: float = 0.0, link_gibps: float = 0.0,
                   stage_step_bytes: float = 0.0) -> tuple[float, float]:
    """(T_proj, T_attn) in ms for one decode step of `batch` sequences at context `context`;
    stage_step_bytes: what the unit's whole stage reads per step (sets the L3 share of KV reads)."""
    cal = rates.calibration
    t_proj = _ms(batch * unit.proj_flops_per_token, rates.decode_gflops,
                 weight_read_bytes(unit, batch), rates.weight_gibps or rates.mem_gibps, cal)
    kv = batch * unit.kv_bytes_per_token * context
    flops = batch * unit.attn_flops_per_context_token * context
    local = kv * (1 - streamed_kv_fraction)
    # η_kv: the attention kernels stream KV less efficiently than the GEMVs stream weights
    t_attn = _ms(flops, rates.decode_gflops, local,
                 kv_read_gibps(rates, max(stage_step_bytes, local)) * cal.eta_kv, cal)
    if streamed_kv_fraction and kv:
        t_attn = max(t_attn, _ms(0, 1, local, rates.mem_gibps * cal.eta_kv, cal)
                     + 1e3 * kv * streamed_kv_fraction / (link_gibps * GIB))
    return t_proj, t_attn


def unit_prefill_ms(unit: UnitIR, rates: DeviceRates, batch: int, prompt: int, prefix: int = 0) -> float:
    """One prefill step of `prompt` tokens per sequence after `prefix` cached ones (a chunk of a
    longer prompt): the projections — the head's for the last position only, as the executor
    computes logits for it alone — then the causal attention of the chunk over prefix + chunk,
    at η_c·η_attn (a fused attention kernel and the projections' GEMMs run at different rates),
    reading the prefix's KV."""
    cal = rates.calibration
    rows = 1 if unit.kind == "head" else prompt
    t_proj = _ms(batch * rows * unit.proj_flops_per_token, rates.prefill_gflops_at(batch * prompt),
                 weight_read_bytes(unit, batch * prompt), rates.weight_gibps or rates.mem_gibps, cal)
    pairs = prompt * prefix + prompt * (prompt + 1) / 2  # (query, visible key) pairs
    t_attn = _ms(batch * pairs * unit.attn_flops_per_context_token,
                 (rates.attn_gflops or rates.prefill_gflops) * cal.eta_attn,
                 batch * prefix * unit.kv_bytes_per_token, rates.mem_gibps * cal.eta_kv, cal)
    return t_proj + t_attn


def streamed_block_prefill_ms(unit: UnitIR, gpu: DeviceRates, link, batch: int, prompt: int,
                              prefix: int = 0, crossings: int = 1) -> float:
    """A CPU-stage block's prompt step run on the GPU with its weights streamed over the link
    (executor/streamed_prefill.py): the weights' crossing overlapped with the GPU's work on them
    (the slower of the two), then the K/V the step copies: the sequences' cached prefix in (once:
    every query block's flash attention reads the one copy), the step's own tokens back out to
    the stage's host pages. crossings: the steps the prompt takes (each crosses the weights again)."""
    upload = crossings * 1e3 * unit.weight_bytes / (link.h2d_gibps * GIB)
    kv = batch * unit.kv_bytes_per_token
    copies = 1e3 * (kv * prefix / (link.h2d_gibps * GIB) + kv * prompt / (link.d2h_gibps * GIB))
    return max(upload, unit_prefill_ms(unit, gpu, batch, prompt, prefix)) + copies


def streamed_riders_ms(blocks: tuple[UnitIR, ...], link, riders: float, rider_context: float) -> float:
    """Decodes riding along in a streamed prompt step (the streamed path runs all of a step's
    rows): each of the streamed `blocks` copies their cached K/V in (`rider_context` tokens over
    all `riders` of them) and their new token's K/V back out to the stage's host pages."""
    kv = sum(u.kv_bytes_per_token for u in blocks if u.kind == "block")
    return 1e3 * kv * (rider_context / (link.h2d_gibps * GIB) + riders / (link.d2h_gibps * GIB))


def streamed_handoff_ms(units: tuple[UnitIR, ...], link, rows: int) -> float:
    """The streamed step's hidden state to the GPU and back: rows of the first block's input."""
    act = 1e3 * rows * units[0].act_bytes_per_token
    return link.h2d_latency_us / 1e3 + act / (link.h2d_gibps * GIB) + link.d2h_latency_us / 1e3 + \
        act / (link.d2h_gibps * GIB)


def stream_prefill_min_rows(units: tuple[UnitIR, ...], k: int, machine: MachineProfile, calibration=None,
                            dtype: str | None = None) -> int | None:
    """The fewest tokens of a prompt step from which the CPU stage's blocks (units [1, k)) finish
    sooner on the GPU with their weights streamed than on the CPU (at no cached prefix, where the
    CPU's attention is cheapest); None where they never do within MAX_STEP_TOKENS, or where there
    is nothing to stream to: no GPU stage beside a CPU stage with blocks, no measured link, or a
    GPU on which flash attention does not run, or weights in another dtype than half precision,
    which flash attention takes (the streamed steps' attention needs it, as the GPU stage's prompt
    chunks do; the executor streams only where it runs for the model: executor/loader.py)."""
    gpu = machine.gpu
    if gpu is None or machine.link is None or not gpu.flash_attention or not 1 < k < len(units) or \
            dtype not in ("bfloat16", "float16"):
        return None
    blocks = [u for u in units[1:k] if u.kind == "block"]
    if not blocks:
        return None
    calibration = calibration or machine.calibration
    cpu_rates = device_rates(machine, "cpu", calibration, dtype)
    gpu_rates = device_rates(machine, "cuda", calibration, dtype)

    def gain(rows: int) -> float:  # ms the stream saves on a step of `rows` tokens (one sequence)
        saved = sum(n * (unit_prefill_ms(u, cpu_rates, 1, rows)
                         - streamed_block_prefill_ms(u, gpu_rates, machine.link, 1, rows)) for u, n in _alike(blocks))
        return saved - streamed_handoff_ms(units, machine.link, rows)

    if gain(MAX_STEP_TOKENS) <= 0:
        return None
    lo, hi = 1, MAX_STEP_TOKENS  # the stream wins at hi; the CPU's time grows with rows faster than the stream's
    while lo < hi:
        mid = (lo + hi) // 2
        if gain(mid) > 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _streamed_step_tokens(fit, ring: int, most: int, host_budget_bytes: int, same_pages: bool = True) -> int:
    """The most tokens (up to `most`: a step holds no more than its sequences' prompts) a streamed
    prompt step may take in what the split leaves of the VRAM and host memory at its context,
    each step crossing the CPU stage's weights once: as many as fit with the same device KV pages
    (never a page less for decode; not same_pages: as many as fit at all, KV pages parked to make
    room), rounded down to a multiple of STREAM_ROWS_GRAIN; a prompt chunk at least, fitting or
    not (where it does not, the caller plans the split without streaming). fit(ring, rows): see
    evaluate_split."""
    least = max(1, min(most, PREFILL_CHUNK_TOKENS))

    def fits(rows: int, pages: int | None = None) -> bool:
        reasons, sized, _, host = fit(ring, rows)
        return not reasons and host <= host_budget_bytes and (pages is None or sized[0] == pages)

    if not fits(least):
        return least
    pages = fit(ring, least)[1][0] if same_pages else None
    lo, hi = least, max(least, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid, pages):
            lo = mid
        else:
            hi = mid - 1
    return lo if lo in (least, most) else max(least, lo // STREAM_ROWS_GRAIN * STREAM_ROWS_GRAIN)


def stream_ring_bytes(units: tuple[UnitIR, ...], k: int) -> int:
    """Device memory of the streamed steps' ring of weight pieces (the executor's slots are no
    larger than its largest weight, which a block's bytes bound)."""
    return STREAM_SLOTS * min(STREAM_PIECE_BYTES, max(u.weight_bytes for u in units[1:k] if u.kind == "block"))


def _size_gpu(k: int, units: tuple[UnitIR, ...], machine: MachineProfile, gpu_weights: int, gpu_budget_bytes: int,
              needed: int, dev_page: int, ring: int, streamed_step: int, *, offload: bool, watermark: float,
              dtype: str | None, batch: int, context: int, page_size_tokens: int,
              pages: int) -> tuple[list[str], tuple[int, int, int, int]]:
    """(why the GPU stage does not fit, [] when it does; (device pages, host pages, working set,
    GPU bytes)) of split k: where its KV pages live, and the VRAM it works in beside them, `ring`
    (the streamed prompt steps' weight pieces) and `streamed_step` (the largest such step's own
    memory, working_set.streamed_step_bytes) included."""
    if k == len(units):
        return [], (needed, 0, 0, 0)
    gpu = machine.gpu

    def work(device_pages: int) -> int:  # sequences: what the whole KV budget holds, wherever its pages live
        return ring + gpu_working_bytes(units[k:], dtype=dtype, batch=batch, context=context,
                                        page_size_tokens=page_size_tokens, budget_pages=batch * pages,
                                        device_pages=device_pages, device_page_bytes=dev_page,
                                        stream_workspace_bytes=(gpu.stream_workspace_bytes or 0) if gpu else 0,
                                        flash_attention=gpu.flash_attention if gpu else None,
                                        streamed_step=streamed_step)

    device_pages, host_pages = needed, 0

    def fits(pages: int) -> bool:
        return gpu_weights + pages * dev_page + work(pages) <= gpu_budget_bytes

    # Offload parks pages only where they do not all fit: where they do, the layout is the one
    # without offload (which fills the VRAM the same way), never a slower one under the watermark.
    # All of them may fit where fewer do not, since a sequence then never streams its chunks.
    if offload and dev_page and not fits(needed):
        room = max(0, gpu_budget_bytes - gpu_weights - work(0))
        # the decode graphs' gather grows with the pool: the most pages under the watermark that
        # fit beside it; below `needed` what they need only grows with their number (bisect)
        lo, hi = 0, min(needed - 1, int(watermark * room // dev_page))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        device_pages = max(lo, 0)
        host_pages = needed - device_pages
    gpu_work = work(device_pages)
    gpu_bytes = gpu_weights + device_pages * dev_page + gpu_work
    reasons = []
    if gpu is None:
        reasons.append("machine profile has no GPU")
    elif gpu_weights > gpu_budget_bytes:
        reasons.append(f"cuda weights need {fmt_bytes(gpu_weights)} > {fmt_bytes(gpu_budget_bytes)} usable VRAM")
    elif gpu_bytes > gpu_budget_bytes:
        reasons.append(f"cuda needs {fmt_bytes(gpu_bytes)} (weights {fmt_bytes(gpu_weights)} + KV "
                       f"{fmt_bytes(device_pages * dev_page)} + working set {fmt_bytes(gpu_work)}{_ring_note(ring)}) > "
                       f"{fmt_bytes(gpu_budget_bytes)} usable VRAM")
    elif host_pages and device_pages < MIN_DEVICE_PAGES_WITH_OFFLOAD:
        reasons.append(f"cuda weights leave room for {device_pages} KV page(s) of {fmt_bytes(dev_page)}"
                       f"{_ring_note(ring, ' beside')}; offload needs >= {MIN_DEVICE_PAGES_WITH_OFFLOAD}")
    return reasons, (device_pages, host_pages, gpu_work, gpu_bytes)


def _ring_note(ring: int, how: str = ",") -> str:
    return f"{how} the streamed prompt steps' ring of {fmt_bytes(ring)}" + (" included" if how == "," else "") \
        if ring else ""


def stage_weight_bytes(units: tuple[UnitIR, ...], start: int, end: int,
                       shared: tuple[SharedWeight, ...]) -> int:
    """Resident weight bytes of units [start, end): a tied weight is held once per device."""
    total = sum(u.weight_bytes for u in units[start:end])
    for s in shared:
        inside = sum(1 for i in s.units if start <= i < end)
        if inside > 1:
            total -= (inside - 1) * s.weight_bytes
    return total


@dataclass(frozen=True)
class KVLayout:
    """Where the KV cache lives for one split (pages of `page_size_tokens`, all layers of a stage)."""
    pages_per_sequence: int     # ceil(context / page size)
    device_page_bytes: int      # one page over every GPU-stage block
    cpu_page_bytes: int         # one page over every CPU-stage block
    device_pages: int           # pages kept in VRAM
    host_pages: int             # GPU-stage pages parked in pinned host memory (offload)
    cpu_pages: int              # CPU-stage pages (host RAM)


@dataclass(frozen=True)
class StageCost:
    device: str
    unit_start: int
    unit_end: int
    num_blocks: int
    weight_bytes: int
    read_bytes_per_step: int
    kv_bytes: int               # KV the stage reads per step at the context
    proj_ms: float
    attn_ms: float
    overhead_ms: float          # n_blocks · δ (a decode step's)
    prefill_ms: float           # the prompt step, its overhead included
    # the per-block overheads the prompt step pays: n_blocks, times the sub-steps the GPU stage
    # takes a streamed step in
    prefill_overheads: float = 0.0

    @property
    def prefill_roofline_ms(self) -> float:
        return self.prefill_ms - self.prefill_overheads * (self.overhead_ms / self.num_blocks if self.num_blocks else 0)

    @property
    def roofline_ms(self) -> float:
        return self.proj_ms + self.attn_ms

    @property
    def ms(self) -> float:
        return self.roofline_ms + self.overhead_ms


@dataclass(frozen=True)
class SplitCost:
    """Everything the search knows about one candidate split."""
    split_k: int
    feasible: bool
    reason: str                 # why not feasible ("" when feasible)
    stages: tuple[StageCost, ...]
    comm_ms: float
    comm_prefill_ms: float
    kv: KVLayout
    gpu_bytes: int              # weights + device KV + working set
    host_bytes: int             # CPU weights + CPU KV + offloaded pages + working set
    gpu_budget_bytes: int
    host_budget_bytes: int
    gpu_work_bytes: int = 0     # the GPU stage's working set (planner/working_set.py), the ring below included
    # prompt steps of at least this many tokens run the CPU stage's blocks on the GPU, weights
    # streamed (stream_prefill_min_rows); None: on the CPU
    stream_prefill_min_rows: int | None = None
    cpu_work_bytes: int = 0     # the CPU stage's, in host memory
    stream_prefill_step_tokens: int | None = None  # the most tokens a streamed step takes

    def stage_ms(self, device: str) -> float:
        return sum(s.ms for s in self.stages if s.device == device)

    @property
    def ms(self) -> float:
        return sum(s.ms for s in self.stages) + self.comm_ms

    @property
    def roofline_ms(self) -> float:
        return sum(s.roofline_ms for s in self.stages) + self.comm_ms

    @property
    def ttft_ms(self) -> float:
        return sum(s.prefill_ms for s in self.stages) + self.comm_prefill_ms

    def request_ms(self, new_tokens: int) -> float:
        return request_ms(self.ttft_ms, self.ms, new_tokens)


def request_ms(ttft_ms: float, ms_per_token: float, new_tokens: int) -> float:
    """A request of the workload end to end: its prompt (the first token), then a decode step for
    each further token, all priced at the split's context (what the search minimises)."""
    decode = (new_tokens - 1) * ms_per_token if new_tokens > 1 else 0.0
    total = ttft_ms + decode
    return total if math.isfinite(total) else math.inf  # unpriced (no rates) ranks last, never NaN


def _alike(units) -> list[tuple[UnitIR, int]]:
    """(a unit, how many of `units` cost as it does), in order of first appearance."""
    groups: dict[tuple, list] = {}
    for u in units:
        group = groups.get(u.cost_key)
        if group is None:
            groups[u.cost_key] = [u, 1]
        else:
            group[1] += 1
    return [(u, n) for u, n in groups.values()]


def _request_steps(batch: float, prompt: float, prefix: float, logits: bool, context: float,
                   stream_from: int | None, streamed_rows: int | None,
                   priced_rows: int | None) -> list[tuple[int, int, float, bool]]:
    """The steps the executor takes `batch` requests' prompts of `prompt` tokens in, arriving
    together after `prefix` cached ones: (sequences, tokens of each, cached before them, whether
    logits are made). The engine gives each sequence a chunk a step, in arrival order, as many as
    a step holds (its streamed step where the prompts stream, else the step it is priced for): so
    groups of sequences, one after another, each in step_shape.prompt_steps' steps."""
    seqs = max(1, math.ceil(batch))
    chunk = min(PREFILL_CHUNK_TOKENS, max(1, math.ceil(context)))
    most = streamed_rows if stream_from else (priced_rows or step_tokens(seqs, math.ceil(context)))
    group = min(seqs, max(1, most // chunk))
    steps = []
    for g in [group] * (seqs // group) + ([seqs % group] if seqs % group else []):
        stream_chunk = max(1, streamed_rows // g) if stream_from else PREFILL_CHUNK_TOKENS
        steps += [(g, n, prefix + s, logits and s + n >= prompt) for s, n in prompt_steps(
            math.ceil(prompt), -(-stream_from // g) if stream_from else None, PREFILL_CHUNK_TOKENS, stream_chunk)]
    return steps


def evaluate_split(k: int, units: tuple[UnitIR, ...], shared: tuple[SharedWeight, ...],
                   machine: MachineProfile, *, batch: int, context: int, prompt: int,
                   page_size_tokens: int, watermark: float, offload: bool,
                   gpu_budget_bytes: int, host_budget_bytes: int, calibration=None,
                   prefix: int = 0, dtype: str | None = None, logits: bool = True,
                   stream_prefill: bool | int = True, stream_step_tokens: int | None = None,
                   priced_rows: int | None = None, riders: float = 0, new_tokens: int | None = None,
                   prompt_in_steps: bool = False, bound_ms: float | None = None) -> SplitCost:
    """Cost and feasibility of putting units [0, k) on the CPU and [k, N) on the GPU. The prefill
    figures are for `prompt` tokens after `prefix` cached ones (0: the whole prompt at once),
    the output projection included only with `logits` (a prompt's last chunk); `dtype`: the
    weights' (selects the CPU kernels' measured rates, see device_rates). stream_prefill: the CPU
    stage's prompt steps run on the GPU with their weights streamed from where the cost model
    prices that faster (True), never (False), or from that many tokens (an existing plan's);
    stream_step_tokens: the most tokens such a step takes (an existing plan's; None: as many as
    fit beside the split at its context, _streamed_step_tokens); priced_rows: the step the GPU
    stage is priced for, which it takes a streamed step in sub-steps of (an existing plan's; None:
    step_shape.step_tokens at this batch and context); riders: decodes in the prompt step (they
    take rows of those sub-steps; the rest of their cost is predict.predict_step's). new_tokens:
    the workload's (the search's), by which a split with KV offload takes the layout that serves
    its request soonest, among those whose decode step is within `bound_ms` where any is (the
    search's --latency-bound); None: the first layout that fits (an existing plan's, whose
    streaming policy says which it took). prompt_in_steps: the prefill figures are for a request's whole
    prompt of `prompt` tokens taken as the executor takes it, in steps (step_shape.prompt_steps),
    each after the ones before it, logits in the last; else for one step."""
    n = len(units)
    if not 0 <= k <= n:
        raise ValueError(f"split {k} out of range 0..{n}")
    calibration = calibration or machine.calibration
    has_gpu = machine.has_gpu
    pages = math.ceil(context / page_size_tokens) if context > 0 else 0
    cpu_kv_tok = sum(u.kv_bytes_per_token for u in units[:k])
    gpu_kv_tok = sum(u.kv_bytes_per_token for u in units[k:])
    dev_page = page_size_tokens * gpu_kv_tok
    cpu_page = page_size_tokens * cpu_kv_tok
    needed = batch * pages if gpu_kv_tok else 0
    gpu_weights = stage_weight_bytes(units, k, n, shared)
    cpu_weights = stage_weight_bytes(units, 0, k, shared)

    # The CPU stage's prompt steps streamed to the GPU from some size on, where that is faster
    # (the policy the plan records); their ring of weight pieces is part of the GPU's working set,
    # or, where the search finds the split does not fit with it, the split streams nothing. An
    # existing plan's policy (a number) is what its executor runs: priced whatever this step's
    # budget, which is only a question asked of the plan (predict).
    if not (has_gpu and 1 < k < n and any(u.kind == "block" for u in units[1:k])):
        stream_rows = None  # nothing to stream, or nowhere to stream it to
    elif stream_prefill is True:
        stream_rows = stream_prefill_min_rows(units, k, machine, calibration, dtype)
    else:
        stream_rows = stream_prefill or None
    cpu_pages = batch * pages if cpu_kv_tok else 0

    def fit(ring: int, rows: int | None, park: bool = False):
        """(why the GPU stage does not fit, (device pages, host pages, GPU work, GPU bytes), host
        work, host bytes) with a ring and streamed steps of up to `rows` tokens (None: none), KV
        pages that do not fit parked on the host where `park`."""
        step = streamed_step_bytes(units[1:k], rows, page_size_tokens, dtype, context) if rows else 0
        reasons, sized = _size_gpu(k, units, machine, gpu_weights, gpu_budget_bytes, needed, dev_page, ring, step,
                                   offload=park, watermark=watermark, dtype=dtype, batch=batch, context=context,
                                   page_size_tokens=page_size_tokens, pages=pages)
        # the sequences the KV budget holds bound the host's step, wherever the pages live
        work = cpu_working_bytes(units[:k], dtype=dtype, batch=batch, context=context,
                                 page_size_tokens=page_size_tokens, budget_pages=batch * pages, gpu_units=units[k:],
                                 streamed_rows=rows or 0)
        return reasons, sized, work, cpu_weights + cpu_pages * cpu_page + sized[1] * dev_page + work

    def variants():
        """(ring, the most tokens a streamed step takes, park) to try, in order: with the ring, then
        without (which may fit where it does not); with offload, KV pages parked on the host only
        where neither fits with all of them in VRAM (offload parks the pages that do not fit)."""
        for park in (False, True) if offload else (False,):
            if stream_rows:
                ring = stream_ring_bytes(units, k)
                most = min(STREAMED_STEP_TOKENS, math.ceil(batch * context))  # a step holds no more than the prompts
                rows = stream_step_tokens or _streamed_step_tokens(
                    lambda ring, rows: fit(ring, rows, park), ring, most, host_budget_bytes)
                if rows >= stream_rows or stream_prefill is not True:
                    yield ring, rows, park
                # else no step the search would allow reaches the threshold: nothing streams
                if park and new_tokens is not None and stream_step_tokens is None and rows < most:
                    # larger steps for device pages parked (fewer crossings of the weights for a
                    # long prompt, more pages copied in for decode): the request decides
                    wider = _streamed_step_tokens(lambda ring, rows: fit(ring, rows, park), ring, most,
                                                  host_budget_bytes, same_pages=False)
                    if wider > rows and wider >= stream_rows:
                        yield ring, wider, park
            if not stream_rows or stream_prefill is True:
                yield 0, None, park

    def priced(ring: int, streamed_rows: int | None, fitted) -> SplitCost:
        """The split with this layout (a variant and what `fit` found of it) priced."""
        gpu_reasons, sized, cpu_work, host_bytes = fitted
        stream_from = stream_rows if ring else None
        device_pages, host_pages, gpu_work, gpu_bytes = sized
        reasons = list(gpu_reasons)

        if host_bytes > host_budget_bytes:
            reasons.append(f"host needs {fmt_bytes(host_bytes)} (weights {fmt_bytes(cpu_weights)} + KV "
                           f"{fmt_bytes(host_bytes - cpu_weights - cpu_work)} + working set {fmt_bytes(cpu_work)}) > "
                           f"{fmt_bytes(host_budget_bytes)} available")

        link = machine.link
        streamed = host_pages / needed if needed else 0.0
        # the prompt's steps: (sequences, tokens of each, cached before them, whether logits are
        # made); else one step of `prompt` tokens for each of `batch` after `prefix`
        steps = _request_steps(batch, prompt, prefix, logits, context, stream_from, streamed_rows, priced_rows) \
            if prompt_in_steps else [(batch, prompt, prefix, logits)]
        gpu_rates = device_rates(machine, "cuda", calibration, dtype) if stream_from else None  # streamed steps'
        stages = []
        for device, start, end in (("cpu", 0, k), ("cuda", k, n)):
            if start == end:
                continue
            if device == "cuda" and not has_gpu:
                stages.append(StageCost(device, start, end, sum(u.kind == "block" for u in units[start:end]),
                                        gpu_weights, 0, 0, math.inf, 0.0, 0.0, math.inf))
                continue
            rates = device_rates(machine, device, calibration, dtype)
            proj = attn = 0.0
            groups = _alike(units[start:end])  # a stage's blocks cost alike: each priced once
            read_bytes = sum(n * weight_read_bytes(u, batch) for u, n in groups)
            step_bytes = read_bytes + batch * context * (gpu_kv_tok if device == "cuda" else cpu_kv_tok)
            for u, alike in groups:
                p, a = unit_decode_ms(u, rates, batch, context, streamed if device == "cuda" else 0.0,
                                      link.h2d_gibps if link else 0.0, step_bytes)
                proj += alike * p
                attn += alike * a
            blocks = sum(n for u, n in groups if u.kind == "block")
            overhead = blocks * rates.calibration.delta_ms_per_block
            prefill = overheads = 0.0
            for seqs, rows, cached, last in steps:
                # the step's prompt tokens (seqs·rows: a mean over steps may make them fractional)
                # reach the policy's threshold: the executor streams it (streamed_prefill.py accepts)
                streams_step = streams(seqs * rows, stream_from)
                for u, alike in groups:
                    if device == "cpu" and u.kind == "block" and streams_step:
                        # a step larger than a streamed step (one priced whole) takes several: each a crossing
                        crossings = math.ceil(round(seqs * rows, 6) / streamed_rows)
                        prefill += alike * streamed_block_prefill_ms(u, gpu_rates, link, seqs, rows, cached,
                                                                     crossings=crossings)
                    elif last or u.kind != "head":
                        prefill += alike * unit_prefill_ms(u, rates, seqs, rows, cached)
                if device == "cpu" and streams_step:
                    prefill += streamed_handoff_ms(units, link, seqs * rows)
                if device == "cuda" and host_pages and link is not None:
                    # the step's own K/V take device pages, the oldest cached ones park: the attention
                    # of each piece the stage takes the step in (a streamed step's sub-steps) copies
                    # those in, for every block (executor/attention.py: gathered, or streamed where
                    # the sequence outgrows the device pages)
                    held = longest_gather(device_pages, page_size_tokens)
                    parts = pieces(round(rows)) if streams_step else [(0, rows)]
                    parked = sum(min(seqs * (cached + a), max(0.0, seqs * (cached + a + m) - held)) for a, m in parts)
                    prefill += 1e3 * parked * gpu_kv_tok / (link.h2d_gibps * GIB)
                # the GPU stage takes a streamed step in the sub-steps of the step it is priced for
                # (executor/engine.py _forward), each paying its per-block overhead
                sub = sub_steps(seqs, rows, priced_rows or step_tokens(math.ceil(batch), math.ceil(context)),
                                riders=riders) if device == "cuda" and streams_step else 1
                prefill += sub * overhead
                overheads += sub * blocks
            stages.append(StageCost(
                device=device, unit_start=start, unit_end=end, num_blocks=blocks,
                weight_bytes=gpu_weights if device == "cuda" else cpu_weights,
                read_bytes_per_step=read_bytes,
                kv_bytes=batch * context * (gpu_kv_tok if device == "cuda" else cpu_kv_tok),
                proj_ms=proj, attn_ms=attn, overhead_ms=overhead, prefill_ms=prefill, prefill_overheads=overheads))
        comm = comm_prefill = 0.0
        if 0 < k < n and link is not None:
            act = units[k - 1].act_bytes_per_token
            comm = link.h2d_latency_us / 1e3 + 1e3 * batch * act / (link.h2d_gibps * GIB)
            comm_prefill = sum(link.h2d_latency_us / 1e3 + 1e3 * seqs * rows * act / (link.h2d_gibps * GIB)
                               for seqs, rows, _, _ in steps)
        kv = KVLayout(pages_per_sequence=pages, device_page_bytes=dev_page, cpu_page_bytes=cpu_page,
                      device_pages=device_pages if k < n else 0, host_pages=host_pages if k < n else 0,
                      cpu_pages=cpu_pages)
        return SplitCost(split_k=k, feasible=not reasons, reason="; ".join(reasons), stages=tuple(stages),
                         comm_ms=comm, comm_prefill_ms=comm_prefill, kv=kv, gpu_bytes=gpu_bytes,
                         host_bytes=host_bytes, gpu_budget_bytes=gpu_budget_bytes,
                         host_budget_bytes=host_budget_bytes, gpu_work_bytes=gpu_work, cpu_work_bytes=cpu_work,
                         stream_prefill_min_rows=stream_from, stream_prefill_step_tokens=streamed_rows)

    # The first layout that fits; with offload, where its new-token count is known (the search's),
    # the one that fits and serves the workload's request soonest (ties: the first), within the
    # latency bound where one is: a ring that only fits with pages parked can save more on the
    # prompt than the parked pages cost decode, and it is a layout, not the split, that misses a bound.
    def rank(cost: SplitCost) -> tuple[bool, float]:
        return bound_ms is not None and cost.ms > bound_ms, cost.request_ms(new_tokens)

    best = tried = None
    for ring, streamed_rows, park in variants():
        fitted = fit(ring, streamed_rows, park)
        tried = ring, streamed_rows, fitted
        if fitted[0] or fitted[3] > host_budget_bytes:
            continue
        cost = priced(*tried)
        if not offload or new_tokens is None:
            return cost
        if best is None or rank(cost) < rank(best):
            best = cost
    return best if best is not None else priced(*tried)  # nothing fits: the last tried says why
