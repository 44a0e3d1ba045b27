"""Cost terms against hand computations (DESIGN §5), and the worked example of DESIGN §5."""
from __future__ import annotations

import pytest

from planner.cost import (device_rates, evaluate_split, kv_read_gibps, stage_weight_bytes,
                          unit_decode_ms)
from planner.units import GIB, MIB
from planner.working_set import gpu_working_bytes
from tests.planner.helpers import machine, model_units, unit, with_vram


def split(k, units, shared, m, **kw):
    args = dict(batch=1, context=1024, prompt=16, page_size_tokens=512, watermark=0.8, offload=False,
                gpu_budget_bytes=m.gpu.vram_usable_bytes if m.gpu else 0,
                host_budget_bytes=m.cpu.ram_available_bytes)
    args.update(kw)
    return evaluate_split(k, units, shared, m, **args)


def test_projection_is_the_slower_of_compute_and_memory():
    m = machine(cpu_gibps=10.0, cpu_gflops=100.0)
    cpu = device_rates(m, "cpu")
    u = unit(1, "block", GIB, proj=2 * GIB)      # 2 FLOP per 2-byte weight: 1 FLOP/byte
    proj, attn = unit_decode_ms(u, cpu, batch=1, context=0)
    assert proj == pytest.approx(1e3 * GIB / (10 * GIB))          # memory: 100 ms
    assert attn == 0
    slow = device_rates(machine(cpu_gflops=1.0), "cpu")
    proj, _ = unit_decode_ms(u, slow, batch=1, context=0)
    assert proj == pytest.approx(1e3 * 2 * GIB / 1e9)             # compute: 2147 ms
    # batch multiplies FLOPs, not weight bytes
    proj, _ = unit_decode_ms(u, cpu, batch=8, context=0)
    assert proj == pytest.approx(1e3 * 8 * 2 * GIB / 100e9)


def test_embedding_reads_rows_not_the_table():
    cpu = device_rates(machine(cpu_gibps=10.0), "cpu")
    emb = unit(0, "embedding", GIB, read=8192, proj=0)
    assert unit_decode_ms(emb, cpu, batch=1, context=0)[0] == pytest.approx(1e3 * 8192 / (10 * GIB))
    assert unit_decode_ms(emb, cpu, batch=4, context=0)[0] == pytest.approx(1e3 * 4 * 8192 / (10 * GIB))


def test_cpu_kv_bandwidth_blends_l3_and_dram():
    cpu = device_rates(machine(cpu_gibps=10.0, l3_bytes=32 * MIB, l3_gibps=30.0), "cpu")
    assert kv_read_gibps(cpu, 4 * MIB) == 30.0                    # α = 1: fits in L3
    assert kv_read_gibps(cpu, 64 * MIB) == pytest.approx(20.0)    # α = 1/2
    assert kv_read_gibps(cpu, 320 * MIB) == pytest.approx(0.1 * 30 + 0.9 * 10)
    b = unit(1, "block", 0, kv=4096, attn=0, proj=0)
    _, attn = unit_decode_ms(b, cpu, batch=1, context=1024)       # W_kv = 4 MiB, in L3
    assert attn == pytest.approx(1e3 * 4 * MIB / (30 * GIB))
    _, attn = unit_decode_ms(b, cpu, batch=1, context=16384)      # W_kv = 64 MiB, α = 0.5
    assert attn == pytest.approx(1e3 * 64 * MIB / (20 * GIB))
    # ... unless the whole stage streams more per step than L3 holds: between two reads of this
    # block's KV, 320 MiB passes through the 32 MiB cache, so α = 0.1 (cost.py's departure from DESIGN)
    _, attn = unit_decode_ms(b, cpu, batch=1, context=1024, stage_step_bytes=320 * MIB)
    assert attn == pytest.approx(1e3 * 4 * MIB / ((0.1 * 30 + 0.9 * 10) * GIB))
    gpu = device_rates(machine(hbm_gibps=100.0), "cuda")          # the GPU reads KV at HBM speed
    _, attn = unit_decode_ms(b, gpu, batch=1, context=1024)
    assert attn == pytest.approx(1e3 * 4 * MIB / (100 * GIB))
    # F_attn = 4·h_a·d_h·c can make attention compute-bound: 16.8 MFLOP at 100 GFLOP/s
    _, attn = unit_decode_ms(unit(1, "block", 0, kv=4096, attn=16384, proj=0), cpu, batch=1, context=1024)
    assert attn == pytest.approx(1e3 * 16384 * 1024 / 100e9)


def test_split_totals_link_term_and_delta():
    units, shared = model_units(4, block_bytes=100 * MIB, emb_bytes=50 * MIB, head_bytes=60 * MIB, kv=0, attn=0)
    m = machine(cpu_gibps=10.0, hbm_gibps=100.0, link_gibps=10.0, latency_us=10.0, delta_cpu=0.5, delta_gpu=0.1)
    c = split(3, units, shared, m)                                  # cpu: emb + 2 blocks; gpu: 2 blocks + head
    cpu_ms = 1e3 * (8192 + 2 * 100 * MIB) / (10 * GIB) + 2 * 0.5
    gpu_ms = 1e3 * (2 * 100 * MIB + 60 * MIB) / (100 * GIB) + 2 * 0.1
    comm_ms = 10e-3 + 1e3 * 8192 / (10 * GIB)
    assert c.stage_ms("cpu") == pytest.approx(cpu_ms)
    assert c.stage_ms("cuda") == pytest.approx(gpu_ms)
    assert c.comm_ms == pytest.approx(comm_ms)
    assert c.ms == pytest.approx(cpu_ms + gpu_ms + comm_ms)
    assert c.roofline_ms == pytest.approx(c.ms - 2 * 0.5 - 2 * 0.1)
    for k in (0, len(units)):                                       # single device: no link term
        assert split(k, units, shared, m).comm_ms == 0


def work(units, *, context=1024, device_pages, budget_pages=2, page=4 * MIB):
    """The GPU stage's working set as planner/working_set.py prices it (tested by hand there)."""
    return gpu_working_bytes(units, dtype="bfloat16", batch=1, context=context, page_size_tokens=512,
                             budget_pages=budget_pages, device_pages=device_pages, device_page_bytes=page)


def test_vram_feasibility_counts_weights_kv_pages_and_working_set_exactly():
    units, shared = model_units(2, block_bytes=100 * MIB, emb_bytes=10 * MIB, head_bytes=10 * MIB, kv=4096)
    # GPU holds blocks 1..2 + head; KV page = 512 tokens × 2 blocks × 4096 B = 4 MiB; context 1024 → 2 pages
    working = work(units[1:], device_pages=2)
    need = 2 * 100 * MIB + 10 * MIB + 2 * 4 * MIB + working
    m = machine()
    ok = split(1, units, shared, m, gpu_budget_bytes=need)
    assert ok.feasible and ok.gpu_bytes == need and ok.kv.device_pages == 2 and ok.kv.device_page_bytes == 4 * MIB
    assert ok.gpu_work_bytes == working > 0
    bad = split(1, units, shared, m, gpu_budget_bytes=need - 1)
    assert not bad.feasible and "KV" in bad.reason and "working set" in bad.reason and "usable VRAM" in bad.reason
    host = split(3, units, shared, m, host_budget_bytes=10 * MIB + 2 * 100 * MIB + 2 * 4 * MIB - 1)
    assert not host.feasible and "host needs" in host.reason
    nogpu = split(1, units, shared, machine(gpu=False))
    assert not nogpu.feasible and nogpu.reason == "machine profile has no GPU"
    assert split(4, units, shared, machine(gpu=False)).feasible


def test_a_gpu_stage_of_the_head_alone_prices_the_logits_of_every_sequence():
    """A GPU stage without blocks has no KV pages, yet it computes the logits of every sequence
    the plan's KV budget holds (the engine runs that many: executor/engine.py)."""
    from dataclasses import replace

    units, shared = model_units(2, block_bytes=100 * MIB, emb_bytes=10 * MIB, head_bytes=10 * MIB)
    units = units[:-1] + (replace(units[-1], work_values_per_token=1000),)
    head_only = split(3, units, shared, machine(), batch=4)  # 4 sequences of 2 pages: 8 may share them
    assert head_only.gpu_work_bytes == work(units[3:], device_pages=0, budget_pages=8) == 8 * 1000 * (4 + 2)


def test_gpu_decode_streams_weights_at_the_profiled_projection_rate():
    """Where the profile timed the GPU stage's decode projection (GpuProfile.gemv_gibps), its
    weights are priced at that rate, its KV reads still at HBM's; without it, at HBM's."""
    from dataclasses import replace

    units, shared = model_units(2, block_bytes=100 * MIB, emb_bytes=10 * MIB, head_bytes=10 * MIB)
    m = machine(hbm_gibps=100.0)
    copy_rate = split(0, units, shared, m)
    same = split(0, units, shared, replace(m, gpu=replace(m.gpu, gemv_gibps=100.0)))
    assert same.stage_ms("cuda") == copy_rate.stage_ms("cuda")
    half = split(0, units, shared, replace(m, gpu=replace(m.gpu, gemv_gibps=50.0)))
    assert 1.9 < half.stage_ms("cuda") / copy_rate.stage_ms("cuda") < 2.0    # weights at half the rate, KV (8 MiB) as before


def test_kv_offload_parks_pages_on_the_host_and_streams_them_back():
    units, shared = model_units(2, block_bytes=100 * MIB, emb_bytes=10 * MIB, head_bytes=10 * MIB, kv=4096)
    m = machine(hbm_gibps=100.0, link_gibps=10.0)
    weights = 2 * 100 * MIB + 10 * MIB
    # context 4096 → 8 pages of 4 MiB needed. The room after weights and the working set without
    # pages, 0.8 × 20 MiB under the watermark, holds 4 pages; but each page also grows the decode
    # graphs' gather, and the pool's scratch page comes with the first: 2 pages fit beside them.
    budget = weights + work(units[1:], context=4096, device_pages=0, budget_pages=8) + 20 * MIB
    c = split(1, units, shared, m, context=4096, offload=True, gpu_budget_bytes=budget)
    assert c.feasible, c.reason
    assert (c.kv.device_pages, c.kv.host_pages) == (2, 6)
    assert c.gpu_bytes == weights + 2 * 4 * MIB + work(units[1:], context=4096, device_pages=2, budget_pages=8) <= budget
    assert weights + 3 * 4 * MIB + work(units[1:], context=4096, device_pages=3, budget_pages=8) > budget
    # the host also holds the embedding stage's working set: its hidden states handed over, 512
    # tokens of a prompt chunk at 8192 B each, in fp32 (tests/planner/test_working_set.py)
    assert c.host_bytes == 10 * MIB + 6 * 4 * MIB + c.cpu_work_bytes and c.cpu_work_bytes == 512 * 8192 * 2
    full = split(1, units, shared, m, context=4096, gpu_budget_bytes=GIB)
    streamed = 6 / 8 * 2 * 4096 * 4096
    extra = c.stage_ms("cuda") - full.stage_ms("cuda")
    assert extra == pytest.approx(1e3 * streamed / (10 * GIB) - 1e3 * streamed / (100 * GIB))
    # without offload the same budget is infeasible; with too little room even offload is
    assert not split(1, units, shared, m, context=4096, gpu_budget_bytes=budget).feasible
    tight = split(1, units, shared, m, context=4096, offload=True, gpu_budget_bytes=budget - 10 * MIB)
    assert not tight.feasible and "offload needs" in tight.reason


def test_kv_offload_parks_pages_only_where_no_layout_holds_them_all():
    """With offload a split first tries what it tries without: the streamed prompt steps' ring, then
    no ring, each with every KV page in VRAM; pages are parked only where neither fits. Here the
    ring fits only by parking 6 of 32 pages, which would stream back every decode step."""
    units, shared = model_units(8, block_bytes=256 * MIB, emb_bytes=64 * MIB, head_bytes=64 * MIB, kv=16384)
    budget = 2053531238
    m = machine(flash_attention=True, l3_bytes=8 * MIB, vram_usable=budget)
    args = dict(context=16384, prompt=512, gpu_budget_bytes=budget, host_budget_bytes=64 * GIB, dtype="bfloat16")
    plain = split(6, units, shared, m, **args)
    offload = split(6, units, shared, m, offload=True, **args)
    assert plain.feasible and plain.stream_prefill_min_rows is None  # no room for the ring beside 32 pages
    assert (offload.kv.device_pages, offload.kv.host_pages) == (plain.kv.device_pages, 0) == (32, 0)
    assert offload.ms == plain.ms and offload.ttft_ms == plain.ttft_ms
    # the ring's layout, which parks pages, is what a budget too small for every page gets
    tight = split(6, units, shared, m, offload=True, **{**args, "gpu_budget_bytes": budget - 64 * MIB})
    assert tight.feasible and tight.kv.host_pages > 0


def test_a_prompt_whose_cached_keys_park_copies_them_in_at_every_step():
    """The split above at k = 1 with offload, at a budget that holds 10 of its 32 pages: a 16384-token
    prompt (32 steps of 512 on the GPU stage, which takes every block here) fills the device
    pages, then each step's own K/V take device pages and the oldest cached ones park; its
    attention copies the parked ones in over the link. The TTFT counts those copies: the steps'
    parked tokens times the GPU stage's K/V bytes per token at the link's rate, beside the same
    layout with every page in VRAM (a budget that holds them)."""
    units, shared = model_units(8, block_bytes=256 * MIB, emb_bytes=64 * MIB, head_bytes=64 * MIB, kv=16384)
    m = machine(l3_bytes=8 * MIB)
    args = dict(context=16384, prompt=16384, host_budget_bytes=64 * GIB, dtype="bfloat16", offload=True,
                prompt_in_steps=True)
    budget = 3 * GIB
    parked = split(1, units, shared, with_vram(m, budget), gpu_budget_bytes=budget, **args)
    roomy = split(1, units, shared, m, gpu_budget_bytes=8 * GIB, **args)
    assert parked.feasible and (parked.kv.device_pages, parked.kv.host_pages, roomy.kv.host_pages) == (10, 22, 0)
    resident = parked.kv.device_pages * 512  # tokens the device pages hold
    copied = sum(min(s, max(0, s + 512 - resident)) for s in range(0, 16384, 512))
    kv_token = sum(u.kv_bytes_per_token for u in units[1:])
    assert copied > 0
    assert parked.ttft_ms - roomy.ttft_ms == pytest.approx(1e3 * copied * kv_token / (m.link.h2d_gibps * GIB))


def test_a_streamed_steps_sub_steps_each_copy_the_parked_keys_in():
    """The streamed split below (k = 6, the ring with 16 of its 32 pages parked), a 16384-token
    prompt in streamed steps of 2048: the GPU stage takes each step in sub-steps of a 512-token
    piece, and each piece's attention copies the sequence's parked keys in. The TTFT counts them
    piece by piece, beside the same policy with every page in VRAM."""
    from planner.step_shape import pieces, prompt_steps

    units, shared = model_units(8, block_bytes=256 * MIB, emb_bytes=64 * MIB, head_bytes=64 * MIB, kv=16384)
    budget = 2053531238
    m = machine(flash_attention=True, l3_bytes=8 * MIB, vram_usable=budget)
    args = dict(context=16384, prompt=16384, host_budget_bytes=64 * GIB, dtype="bfloat16", offload=True,
                prompt_in_steps=True, stream_prefill=10, stream_step_tokens=2048)
    parked = split(6, units, shared, m, gpu_budget_bytes=budget, **args)
    roomy = split(6, units, shared, with_vram(m, 8 * GIB), gpu_budget_bytes=8 * GIB, **args)
    assert (parked.kv.device_pages, parked.kv.host_pages, roomy.kv.host_pages) == (16, 16, 0)
    assert parked.stream_prefill_step_tokens == roomy.stream_prefill_step_tokens == 2048
    held = 16 * 512
    copied = sum(min(start + a, max(0, start + a + n - held))
                 for start, rows in prompt_steps(16384, 10, 512, 2048) for a, n in pieces(rows))
    once_a_step = sum(min(start, max(0, start + rows - held)) for start, rows in prompt_steps(16384, 10, 512, 2048))
    assert copied > once_a_step > 0
    kv_token = sum(u.kv_bytes_per_token for u in units[6:])
    assert parked.ttft_ms - roomy.ttft_ms == pytest.approx(1e3 * copied * kv_token / (m.link.h2d_gibps * GIB))


def test_with_offload_a_split_takes_the_layout_that_serves_the_workloads_request_soonest():
    """The split above, at the budget where the ring fits only with pages parked: the search's
    evaluation, which knows how many tokens a request of the workload generates, weighs the two
    layouts by that request. A short answer takes the ring (its prompt streamed to the GPU, the
    first token 40x sooner), a long one every page in VRAM (each token sooner). An existing
    plan's evaluation (no new-token count) takes the first that fits, as it did."""
    units, shared = model_units(8, block_bytes=256 * MIB, emb_bytes=64 * MIB, head_bytes=64 * MIB, kv=16384)
    budget = 2053531238
    m = machine(flash_attention=True, l3_bytes=8 * MIB, vram_usable=budget)
    args = dict(context=16384, prompt=512, gpu_budget_bytes=budget, host_budget_bytes=64 * GIB, dtype="bfloat16",
                offload=True)
    resident = split(6, units, shared, m, **args)
    assert (resident.kv.device_pages, resident.kv.host_pages, resident.stream_prefill_min_rows) == (32, 0, None)
    short = split(6, units, shared, m, new_tokens=8, **args)
    assert short.kv.host_pages > 0 and short.stream_prefill_min_rows is not None
    assert short.ttft_ms * 40 < resident.ttft_ms and short.ms > resident.ms
    assert short.request_ms(8) < resident.request_ms(8)
    long = split(6, units, shared, m, new_tokens=512, **args)
    assert long.request_ms(512) < short.request_ms(512)
    assert (long.kv, long.ms, long.ttft_ms) == (resident.kv, resident.ms, resident.ttft_ms)
    # under a latency bound (--max-context --latency-bound) that only the resident layout's decode
    # step meets, the short answer takes that one: the split serves within the bound
    bound = (resident.ms + short.ms) / 2
    bounded = split(6, units, shared, m, new_tokens=8, bound_ms=bound, **args)
    assert (bounded.kv, bounded.ms) == (resident.kv, resident.ms) and bounded.ms <= bound
    # and where no layout meets it, the request decides as without one
    assert split(6, units, shared, m, new_tokens=8, bound_ms=resident.ms / 2, **args).kv == short.kv


def test_tied_weights_are_held_once_per_device():
    units, shared = model_units(2, block_bytes=100, emb_bytes=1000, head_bytes=1000 + 8, tied=True)
    assert stage_weight_bytes(units, 0, 4, shared) == 1000 + 200 + 8      # all on one device: once
    assert stage_weight_bytes(units, 0, 2, shared) == 1000 + 100
    assert stage_weight_bytes(units, 2, 4, shared) == 100 + 1008          # split: a copy on each side


# ---- DESIGN §5 worked example: Qwen3-8B on the RTX 4060 laptop ------------------------------------

def test_worked_example_qwen3_8b_on_the_4060_laptop(laptop_plan_8b):
    """DESIGN §5, with its rates read as written, GB/s (the profile's notes say why): k=21
    (embedding + 20 blocks on the CPU, 16 blocks + head on the GPU), 8.6 ms per block on the CPU,
    all-CPU blocks ≈ 310 ms, T_comm ≈ 5 µs. The thesis' stage totals (≈155 + 31 = 186 ms) fit
    neither reading of its units; the planner's, computed here by hand, are 173.4 + 34.3 ms.
    The thesis' k=21 fills the 7 GiB left after the CUDA context with weights and KV alone; the
    GPU stage's working set (activations of a 512-token prompt chunk, ...) does not fit beside
    them, so the plan takes k=22."""
    p = laptop_plan_8b
    thesis = p.search.candidates[21]
    weights_and_kv = p.ir.units[21].weight_bytes * 16 + p.ir.units[-1].weight_bytes + 2 * 16 * 512 * 4096
    assert weights_and_kv <= p.limits.gpu_budget_bytes < thesis.gpu_bytes
    assert not thesis.feasible and "working set" in thesis.reason
    assert p.partition.split_k == 22
    cpu, gpu = p.partition.stages
    assert (cpu.device, cpu.unit_start, cpu.unit_end, cpu.num_blocks) == ("cpu", 0, 22, 21)
    assert (gpu.device, gpu.unit_start, gpu.unit_end, gpu.num_blocks) == ("cuda", 22, 38, 15)
    assert gpu.working_bytes == p.search.candidates[22].gpu_bytes - gpu.weight_bytes - 2 * 15 * 512 * 4096
    block_bytes, head_bytes, kv_block = 385_892_864, 151936 * 4096 * 2 + 4096 * 2, 4096 * 1024
    assert p.ir.units[1].weight_bytes == block_bytes and p.ir.units[-1].weight_bytes == head_bytes
    # one block on the CPU: its weights at 45 GB/s (the thesis' 8.6 ms), plus attention at c = 1024:
    # its 4 MiB of KV would fit the 24 MiB L3, but a CPU stage of 3 units streams ~0.8 GB per step
    # between two reads of it, so it comes at nearly DRAM speed (α = 24 MiB / W_step ≈ 3%)
    per_block = p.search.candidates[3].cpu_ms - p.search.candidates[2].cpu_ms
    proj = 1e3 * block_bytes / 45e9
    attn_dram = 1e3 * kv_block / 45e9
    assert proj == pytest.approx(8.6, abs=0.03)
    assert attn_dram > 1e3 * 4 * 32 * 128 * 1024 / 500e9  # memory-bound, not compute-bound
    assert per_block == pytest.approx(proj + attn_dram, rel=1e-3)
    assert 36 * proj == pytest.approx(310, rel=0.01)       # the thesis' all-CPU blocks
    assert thesis.cpu_ms == pytest.approx(20 * (proj + attn_dram), rel=0.01)  # + the embedding's row
    # the GPU stage: 16 blocks and the head at 218 GB/s, KV read at HBM speed
    assert thesis.cuda_ms == pytest.approx(1e3 * (16 * (block_bytes + kv_block) + head_bytes) / 218e9, rel=1e-3)
    assert thesis.comm_ms == pytest.approx(4.5e-3 + 1e3 * 4096 * 2 / 16e9, rel=1e-3)
    assert thesis.total_ms == pytest.approx(207.7, abs=0.05)
    stage = {s.device: s for s in p.prediction.stages}
    assert stage["cpu"].ms_per_token == pytest.approx(21 * (proj + attn_dram), rel=0.01)
    assert stage["cuda"].ms_per_token == pytest.approx(1e3 * (15 * (block_bytes + kv_block) + head_bytes) / 218e9,
                                                       rel=1e-3)
    assert p.prediction.ms_per_token == p.prediction.roofline_ms_per_token      # δ = 0: "before δ"
    # all-GPU is infeasible (36 × 386 MB ≈ 13.9 GB of blocks > 7 GiB usable), and so is k = 20
    assert not p.search.candidates[0].feasible and not p.search.candidates[20].feasible


def test_measured_kernel_rates_price_the_model_dtype():
    """With the profile's kernel rates for the model's dtype, weights stream at the GEMV's rate,
    prompt GEMMs run at the chosen path's rate and prompt attention at its own; KV reads keep the
    DRAM figure. Another dtype, or none, falls back to the generic figures."""
    from dataclasses import replace

    from planner.cost import unit_prefill_ms
    from planner.machine import CpuKernels, KernelRates, PromptRate

    rates = KernelRates(dtype="bfloat16", gemv_gibps=20.0, gemm_path="gemm", gemm_min_rows=16,
                        gemm_gflops=450.0, gemm_candidates={"gemm": 450.0, "gemv": 100.0},
                        prompt_gflops=(PromptRate(128, 200.0), PromptRate(512, 400.0)), attention_gflops=50.0,
                        attention_kernel_max_queries=16)
    # the block rate by chunk size: measured points, linear in log(rows) between them, flat outside;
    # below gemm_min_rows the GEMV tiles' rate
    assert [rates.prompt_gflops_at(r) for r in (10, 16, 64, 128, 256, 512, 2048)] == \
        pytest.approx([100.0, 200.0, 200.0, 200.0, 300.0, 400.0, 400.0])
    m = machine(cpu_gibps=10.0, cpu_gflops=100.0, l3_bytes=0)
    m = replace(m, cpu=replace(m.cpu, kernels=CpuKernels(isa="avx2", threads=4, fma_peak_gflops=500.0,
                                                          dtypes=(rates,))))
    cpu = device_rates(m, "cpu", dtype="bfloat16")
    u = unit(1, "block", GIB, kv=1024, attn=4096, proj=2 * GIB)
    proj, attn = unit_decode_ms(u, cpu, batch=1, context=1024)
    assert proj == pytest.approx(1e3 * GIB / (20 * GIB))               # the GEMV's 20 GiB/s
    assert attn == pytest.approx(1e3 * 1024 * 1024 / (10 * GIB))       # KV at DRAM's 10 GiB/s
    # a 100-token prompt: projections at the 128-row block rate, 200 GFLOP/s (compute-bound),
    # attention at 50; a 256-token chunk after 256 cached ones at 300
    pairs = 100 * 101 / 2
    expected = 1e3 * (100 * 2 * GIB / 200e9 + pairs * 4096 / 50e9)
    assert unit_prefill_ms(u, cpu, batch=1, prompt=100) == pytest.approx(expected)
    later = 256 * 256 + 256 * 257 / 2
    expected = 1e3 * (256 * 2 * GIB / 300e9 + max(later * 4096 / 50e9, 256 * 1024 / (10 * GIB)))
    assert unit_prefill_ms(u, cpu, batch=1, prompt=256, prefix=256) == pytest.approx(expected)
    for other in (device_rates(m, "cpu", dtype="float16"), device_rates(m, "cpu")):
        assert unit_decode_ms(u, other, batch=1, context=0)[0] == pytest.approx(1e3 * GIB / (10 * GIB))
        assert unit_prefill_ms(u, other, batch=1, prompt=100) == pytest.approx(
            1e3 * (100 * 2 * GIB / 100e9 + pairs * 4096 / 100e9))


def test_a_stage_of_different_blocks_costs_each_as_its_own():
    """A stage prices each kind of unit once (blocks alike by every field but their identity):
    one block unlike the others — more weights, more KV — is priced as itself, not as its
    neighbours, and alike blocks cost as many times one of them."""
    units, shared = model_units(4, block_bytes=100 * MIB, emb_bytes=50 * MIB, head_bytes=60 * MIB, kv=0, attn=0)
    assert units[1].cost_key == units[2].cost_key and units[1].index != units[2].index
    odd = unit(3, "block", 300 * MIB, kv=0)
    assert odd.cost_key != units[1].cost_key
    m = machine(cpu_gibps=10.0, hbm_gibps=100.0, link_gibps=10.0, latency_us=10.0, delta_cpu=0.5, delta_gpu=0.1)
    c = split(len(units), (*units[:3], odd, *units[4:]), shared, m)          # all on the CPU
    rates = device_rates(m, "cpu")
    step = 8192 + 3 * 100 * MIB + 300 * MIB + 60 * MIB
    expected = sum(sum(unit_decode_ms(u, rates, 1, 1024, stage_step_bytes=step))
                   for u in (*units[:3], odd, *units[4:])) + 4 * 0.5
    assert c.stage_ms("cpu") == pytest.approx(expected)
    assert c.stages[0].read_bytes_per_step == step


BF16 = "bfloat16"  # streamed prompt steps need half-precision weights (flash attention)


def _flash(m):
    """The machine with flash attention known to run on its GPU (what streamed prompt steps need)."""
    from dataclasses import replace
    return replace(m, gpu=replace(m.gpu, flash_attention=True))


def test_streamed_prompt_steps_start_where_the_link_beats_the_cpus_gemms():
    """Blocks of 256 MiB doing 256 Mi FLOP per token: on the CPU (100 GFLOP/s, 10 GiB/s) a step of
    r tokens takes max(r · 2.68 ms, 25 ms); streamed, 25 ms crossing a 10 GiB/s link (the GPU's
    work on it, 2.5 ms of HBM reads, hidden under it) plus the K/V copies and the hand-off: the
    stream wins from the first r whose GEMMs outlast the crossing, r = 10."""
    from planner.cost import stream_prefill_min_rows, streamed_block_prefill_ms, unit_prefill_ms

    m = _flash(machine(cpu_gflops=100.0, gpu_gflops=10000.0, link_gibps=10.0))
    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    assert 256 * MIB / 100e9 * 9 < 256 * MIB / (10 * GIB) < 256 * MIB / 100e9 * 10
    assert stream_prefill_min_rows(units, 5, m, dtype=BF16) == 10
    cpu, gpu = device_rates(m, "cpu"), device_rates(m, "cuda")
    block = units[1]
    crossing = 1e3 * 256 * MIB / (10 * GIB)
    kv = 1e3 * 16 * 4096 / (10 * GIB)  # a 16-token step's K/V back to the host (no prefix)
    assert streamed_block_prefill_ms(block, gpu, m.link, 1, 16) == pytest.approx(crossing + kv)
    # a 16-token prompt (the helper's) is priced streamed: embedding on the CPU, 4 blocks streamed,
    # the hidden state there and back
    handoff = 2 * (10e-3 + 1e3 * 16 * 8192 / (10 * GIB))
    streamed = split(5, units, (), m, dtype=BF16).stages[0]
    plain = split(5, units, (), machine(cpu_gflops=100.0, gpu_gflops=10000.0, link_gibps=10.0), dtype=BF16).stages[0]
    embedding = unit_prefill_ms(units[0], cpu, 1, 16)
    assert streamed.prefill_ms == pytest.approx(embedding + 4 * (crossing + kv) + handoff)
    assert plain.prefill_ms == pytest.approx(embedding + 4 * unit_prefill_ms(block, cpu, 1, 16))
    assert streamed.prefill_ms < plain.prefill_ms
    # a 4-token prompt stays on the CPU, as the executor runs it
    assert split(5, units, (), m, prompt=4, dtype=BF16).stages[0].prefill_ms == \
        pytest.approx(unit_prefill_ms(units[0], cpu, 1, 4) + 4 * unit_prefill_ms(block, cpu, 1, 4))


def test_nothing_streams_without_a_place_to_stream_to():
    from dataclasses import replace
    from planner.cost import stream_prefill_min_rows

    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    m = _flash(machine())
    assert stream_prefill_min_rows(units, 5, m, dtype=BF16) is not None
    assert stream_prefill_min_rows(units, 5, machine(), dtype=BF16) is None          # flash attention not known to run
    assert stream_prefill_min_rows(units, 5, replace(m, link=None), dtype=BF16) is None
    assert stream_prefill_min_rows(units, 1, m, dtype=BF16) is None                  # only the embedding on the CPU
    assert stream_prefill_min_rows(units, len(units), m, dtype=BF16) is None         # no GPU stage
    slow_link = _flash(machine(link_gibps=0.001))
    assert stream_prefill_min_rows(units, 5, slow_link, dtype=BF16) is None          # the CPU wins at every step size
    assert stream_prefill_min_rows(units, 5, m, dtype="float32") is None    # flash attention takes half precision


def test_the_ring_of_streamed_weight_pieces_is_vram_the_split_needs_or_it_streams_nothing():
    """The ring (3 slots of min(32 MiB, a block)) is part of the GPU stage's working set, and so is
    the largest streamed step's own memory where it exceeds the stage's own step (they run one
    after the other); a split that fits only without them is planned without streaming, not
    refused."""
    from planner.step_shape import STREAM_PIECE_BYTES, STREAM_SLOTS, STREAMED_STEP_TOKENS
    from planner.working_set import streamed_step_bytes
    from tests.planner.helpers import with_vram

    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    m, plain = _flash(machine()), machine()
    with_ring, without = split(5, units, (), m, dtype=BF16), split(5, units, (), plain, dtype=BF16)
    ring = STREAM_SLOTS * STREAM_PIECE_BYTES
    step = streamed_step_bytes(units[1:5], min(STREAMED_STEP_TOKENS, 1024), 512, BF16, 1024)  # split()'s context, pages
    assert with_ring.stream_prefill_min_rows is not None and without.stream_prefill_min_rows is None
    grown = with_ring.gpu_work_bytes - without.gpu_work_bytes
    assert step > without.gpu_work_bytes  # these blocks' streamed step is the larger: it adds what it exceeds by
    assert ring < grown <= ring + step
    assert with_ring.gpu_bytes - without.gpu_bytes == grown
    tight = without.gpu_bytes + grown // 2  # fits the split, not its streamed steps
    squeezed = split(5, units, (), with_vram(m, tight), gpu_budget_bytes=tight, dtype=BF16)
    assert squeezed.feasible and squeezed.stream_prefill_min_rows is None
    assert squeezed.gpu_bytes == without.gpu_bytes


def test_an_existing_plans_policy_is_priced_whatever_the_budget_a_prediction_asks_about():
    """The search drops streaming where the ring does not fit beside the split; a plan's recorded
    policy is what its executor runs, so a prediction for another step (a bigger KV budget that
    leaves no room for the ring) still prices its prompt steps streamed."""
    from tests.planner.helpers import with_vram

    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    m = _flash(machine())
    planned = split(5, units, (), m, dtype=BF16)
    rows = planned.stream_prefill_min_rows
    tight = split(5, units, (), machine(), dtype=BF16).gpu_bytes + 1 * MIB  # the ring does not fit
    squeezed = with_vram(m, tight)
    searched = split(5, units, (), squeezed, gpu_budget_bytes=tight, dtype=BF16)
    recorded = split(5, units, (), squeezed, gpu_budget_bytes=tight, stream_prefill=rows, dtype=BF16)
    off = split(5, units, (), squeezed, gpu_budget_bytes=tight, stream_prefill=False, dtype=BF16)
    assert searched.stream_prefill_min_rows is None and searched.stages[0].prefill_ms == off.stages[0].prefill_ms
    assert recorded.stream_prefill_min_rows == rows
    assert recorded.stages[0].prefill_ms == pytest.approx(planned.stages[0].prefill_ms)
    assert recorded.stages[0].prefill_ms < off.stages[0].prefill_ms


def test_a_streamed_step_takes_as_many_tokens_as_the_vram_left_holds_never_a_device_page():
    """A streamed step crosses the CPU stage's weights once, so the search gives it as many of a
    prompt's tokens as the split leaves VRAM for at its context (at most STREAMED_STEP_TOKENS, no
    more than the context), its memory priced (working_set.streamed_step_bytes); with less VRAM,
    fewer (a prompt chunk at least); never at the cost of a device KV page, which decode reads."""
    from planner.step_shape import PREFILL_CHUNK_TOKENS, STREAMED_STEP_TOKENS
    from planner.working_set import STREAM_ROWS_GRAIN, streamed_step_bytes
    from tests.planner.helpers import with_vram

    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    m = _flash(machine())
    roomy = split(5, units, (), m, dtype=BF16, context=4096)
    assert roomy.stream_prefill_step_tokens == STREAMED_STEP_TOKENS
    assert split(5, units, (), m, dtype=BF16, context=700).stream_prefill_step_tokens == 700  # its whole context
    # a budget that holds the split with steps of a chunk and some, not of 2048
    least = split(5, units, (), m, dtype=BF16, context=4096, stream_step_tokens=PREFILL_CHUNK_TOKENS)
    step = streamed_step_bytes(units[1:5], 1000, 512, BF16, 4096) - streamed_step_bytes(
        units[1:5], PREFILL_CHUNK_TOKENS, 512, BF16, 4096)
    budget = least.gpu_bytes + step
    squeezed = split(5, units, (), with_vram(m, budget), gpu_budget_bytes=budget, dtype=BF16, context=4096)
    rows = squeezed.stream_prefill_step_tokens
    assert squeezed.feasible and PREFILL_CHUNK_TOKENS < rows < 1000 and rows % STREAM_ROWS_GRAIN == 0
    assert squeezed.gpu_bytes <= budget
    more = split(5, units, (), with_vram(m, budget), gpu_budget_bytes=budget, dtype=BF16, context=4096,
                 stream_step_tokens=rows + STREAM_ROWS_GRAIN)
    assert more.stream_prefill_min_rows is None  # the next grain of tokens does not fit: the split streams nothing
    # with offload, the VRAM beside the split is the device pages': steps never take one of them
    offload = dict(offload=True, context=16384, gpu_budget_bytes=budget)
    paged = split(5, units, (), with_vram(m, budget), dtype=BF16, **offload)
    at_chunk = split(5, units, (), with_vram(m, budget), dtype=BF16, stream_step_tokens=PREFILL_CHUNK_TOKENS,
                     **offload)
    assert paged.kv.device_pages == at_chunk.kv.device_pages and paged.kv.host_pages > 0
    assert paged.stream_prefill_step_tokens >= PREFILL_CHUNK_TOKENS


def test_a_streamed_step_copies_the_cached_prefix_in_once():
    """streamed_block_prefill_ms: the weights' crossing (here the slower than the GPU's work) plus
    the K/V copies: the cached prefix in once however many blocks of PREFILL_CHUNK_TOKENS queries
    read it (the streamed path copies it for all of them), the step's own once out."""
    from planner.cost import streamed_block_prefill_ms
    from planner.step_shape import PREFILL_CHUNK_TOKENS

    m = machine(link_gibps=1.0)
    gpu = device_rates(m, "cuda")
    u = unit(1, "block", 256 * MIB, kv=4096, act=8192, attn=16384)
    h2d = 1e3 * u.kv_bytes_per_token / (m.link.h2d_gibps * GIB)   # ms per cached token copied in
    for prompt in (PREFILL_CHUNK_TOKENS, 3 * PREFILL_CHUNK_TOKENS + 1):
        fresh, after = (streamed_block_prefill_ms(u, gpu, m.link, 1, prompt, prefix) for prefix in (0, 1000))
        assert after - fresh == pytest.approx(1000 * h2d)


def test_the_host_holds_a_streamed_steps_hidden_states():
    """cpu_working_bytes: where the CPU stage's prompt steps stream, the host holds such a step's
    hidden states (the embedding's output and the blocks' returned, fp32) rather than its
    activations: the larger of the two."""
    import json

    from planner.trace import trace_model
    from planner.working_set import cpu_working_bytes
    from tests.planner.conftest import config_path

    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB, act=8192)  # no activations recorded: only them
    args = dict(dtype=BF16, batch=1, context=4096, page_size_tokens=512, budget_pages=8, gpu_units=units[5:])
    none = cpu_working_bytes(units[:5], streamed_rows=0, **args)
    assert cpu_working_bytes(units[:5], streamed_rows=1000, **args) - none == 2 * 1000 * 8192 * 4 // 2
    traced = trace_model(json.loads(open(config_path("qwen3-0.6b")).read())).units
    args.update(gpu_units=traced[10:])
    plain = cpu_working_bytes(traced[:10], **args)
    assert cpu_working_bytes(traced[:10], streamed_rows=512, **args) == plain  # a chunk's activations are more
    assert cpu_working_bytes(traced[:10], streamed_rows=2 ** 16, **args) > plain


def test_a_split_whose_host_memory_holds_it_only_without_streaming_streams_nothing():
    """Streaming's ring can push device KV pages to the host (offload) and its steps' hidden
    states take host memory: where the host then does not hold the split, the search plans it
    without streaming rather than refusing it."""
    from tests.planner.helpers import with_vram

    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    m = _flash(machine())
    args = dict(dtype=BF16, offload=True, context=16384)
    resident = split(5, units, (), m, dtype=BF16, context=16384, stream_prefill=False)  # every page, no ring
    vram = resident.gpu_bytes - 4 * resident.kv.device_page_bytes  # neither layout holds every page
    tight = with_vram(m, vram)
    streams = split(5, units, (), tight, gpu_budget_bytes=vram, **args)
    plain = split(5, units, (), tight, gpu_budget_bytes=vram, stream_prefill=False, **args)
    assert streams.stream_prefill_min_rows is not None and streams.host_bytes > plain.host_bytes
    host = (streams.host_bytes + plain.host_bytes) // 2  # holds the split without streaming only
    searched = split(5, units, (), tight, gpu_budget_bytes=vram, host_budget_bytes=host, **args)
    assert searched.feasible and searched.stream_prefill_min_rows is None and searched.host_bytes == plain.host_bytes


def test_a_plans_ttft_crosses_the_weights_once_per_streamed_step():
    """The plan's one-shot TTFT of a prompt larger than its streamed step prices a crossing of the
    CPU stage's weights for each step the engine takes it in."""
    from planner.cost import streamed_block_prefill_ms

    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    m = _flash(machine(link_gibps=1.0))
    gpu = device_rates(m, "cuda", dtype=BF16)
    one = split(5, units, (), m, dtype=BF16, context=4096, prompt=1000, stream_step_tokens=1000)
    three = split(5, units, (), m, dtype=BF16, context=4096, prompt=1000, stream_step_tokens=400)
    cross = 1e3 * units[1].weight_bytes / (m.link.h2d_gibps * GIB)
    assert three.stages[0].prefill_ms - one.stages[0].prefill_ms == pytest.approx(4 * 2 * cross)
    assert streamed_block_prefill_ms(units[1], gpu, m.link, 1, 1000, crossings=3) >= 3 * cross


def test_the_gpu_stage_pays_its_per_block_overhead_once_per_sub_step_of_a_streamed_step():
    """The GPU stage takes a streamed step in the sub-steps it is priced for (prompt chunks of 512
    tokens, executor/engine.py): a 2048-token streamed step is four of them, each paying δ per
    block; a step that does not stream is one, and a decode step pays δ once whatever the
    workload's prompt."""
    units, _ = model_units(8, 256 * MIB, 64 * MIB, 64 * MIB)
    m = _flash(machine(link_gibps=1.0, delta_gpu=0.5))
    gpu = lambda c: c.stages[1]  # noqa: E731
    no_delta = _flash(machine(link_gibps=1.0))
    streamed = split(5, units, (), m, dtype=BF16, context=4096, prompt=2048, stream_step_tokens=2048)
    bare = split(5, units, (), no_delta, dtype=BF16, context=4096, prompt=2048, stream_step_tokens=2048)
    assert streamed.stream_prefill_min_rows is not None and streamed.stream_prefill_min_rows <= 2048
    assert gpu(streamed).num_blocks == 4 and gpu(streamed).prefill_overheads == 4 * 4
    assert gpu(streamed).prefill_ms - gpu(bare).prefill_ms == pytest.approx(4 * 4 * 0.5)
    assert gpu(streamed).prefill_roofline_ms == pytest.approx(gpu(bare).prefill_ms)
    assert gpu(streamed).overhead_ms == pytest.approx(4 * 0.5)  # the decode step's
    assert gpu(streamed).ms - gpu(bare).ms == pytest.approx(4 * 0.5)
    one = split(5, units, (), m, dtype=BF16, context=4096, prompt=512, stream_step_tokens=2048)
    assert gpu(one).prefill_overheads == 4
    plain = split(5, units, (), m, dtype=BF16, context=4096, prompt=2048, stream_prefill=False)
    assert plain.stream_prefill_min_rows is None and gpu(plain).prefill_overheads == 4
    # sub-steps of the plan's priced step, not of the step's own batch (predict_step keeps it)
    four = split(5, units, (), m, dtype=BF16, batch=4, context=4096, prompt=512, stream_step_tokens=2048)
    assert gpu(four).prefill_overheads == 4  # 4 × 512 fits one priced step of 2048
    assert gpu(split(5, units, (), m, dtype=BF16, batch=4, context=4096, prompt=512, stream_step_tokens=2048,
                     priced_rows=512)).prefill_overheads == 4 * 4
    # decodes riding along take the first sub-step's rows: 3 of them and 2045 prompt tokens make five
    assert gpu(split(5, units, (), m, dtype=BF16, context=4096, prompt=2045, stream_step_tokens=2048,
                     priced_rows=512, riders=3)).prefill_overheads == 5 * 4
