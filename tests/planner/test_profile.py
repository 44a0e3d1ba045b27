"""Machine profiling. The CPU path runs for real; the GPU path runs the same code on CPU tensors
with a mocked memory query (no GPU here), so CUDA specifics are not exercised."""
from __future__ import annotations

import time

import pytest
import torch

from planner.machine import DeviceCalibration, GpuProfile, LinkProfile, load_machine, machine_to_yaml
from planner.planning import make_plan
from planner.profile import (ISA_FLAGS, detect_cpu_facts, measure_gpu, measure_read_bandwidth, probe_cuda,
                             profile_machine, profiled_gpu_delta_ms)
from planner.units import GIB, MIB
from tests.planner.conftest import DEV, config_path


def test_cpu_facts_are_read_from_the_system():
    f = detect_cpu_facts()
    assert f["cores"] >= 1 and f["threads"] >= f["cores"]
    assert set(f["isa"]) <= set(ISA_FLAGS)
    assert f["ram_total_bytes"] >= f["ram_available_bytes"] > 0
    assert f["l3_bytes"] >= 0


def test_read_bandwidth_reports_every_run():
    median, runs = measure_read_bandwidth(64 * MIB, runs=3, min_seconds=0.01)
    assert len(runs) == 3 and min(runs) <= median <= max(runs) and median > 0


def test_quick_profile_is_fast_valid_and_reports_progress():
    messages = []
    threads = torch.get_num_threads()
    start = time.perf_counter()
    # a GPU whose decode-block probe ran: its δ is the block's time beyond its roofline
    gpu = GpuProfile(name="Mock GPU", vram_total_bytes=8 * GIB, vram_usable_bytes=7 * GIB,
                     cuda_context_reserve_bytes=GIB, hbm_gibps=250.0, hbm_gibps_runs=(250.0,), prefill_gflops=2e4,
                     prefill_matmul="mock", gemv_gibps=200.0, decode_block_ms=0.4, decode_block_roofline_ms=0.25,
                     decode_block="mock")
    link = LinkProfile(h2d_gibps=12.0, d2h_gibps=12.0, h2d_latency_us=10.0, d2h_latency_us=10.0, pinned=True)
    m = profile_machine(quick=True, name="test-box", progress=messages.append, gpu_probe=lambda q, p: (gpu, link))
    # ~9 s on an idle 2-core VM, most of it the kernels probe (27 s once beside another test run):
    # a bound against the quick profile turning into a full one, not a timing
    assert time.perf_counter() - start < 60
    assert torch.get_num_threads() == threads                  # measured with all cores, then restored
    assert m.source == "measured" and m.quick and m.name == "test-box" and (m.gpu, m.link) == (gpu, link)
    # the bandwidth buffer dwarfs the L3 (else it measures the cache)
    assert m.cpu.dram_buffer_bytes >= max(GIB, 3 * m.cpu.l3_bytes)
    assert len(m.cpu.dram_read_gibps_runs) == 3 and m.cpu.dram_read_gibps > 0 and m.cpu.compute_gflops > 0
    assert m.cpu.l3_read_source.startswith("estimated")
    assert any("DRAM read" in msg and "run 3/3" in msg for msg in messages)
    # the attention kernel's cold KV rate, relative to DRAM's, is the plans' default η_kv
    assert any("KV read (attention kernel)" in msg and "run 3/3" in msg for msg in messages)
    assert m.calibration.provenance == "profiled" and 0 < m.calibration.cpu.eta_kv <= 1
    assert m.calibration.cuda == DeviceCalibration(delta_ms_per_block=0.15)
    assert load_machine(machine_to_yaml(m)) == m


def test_gpu_measurements_on_a_mocked_device():
    syncs, timed, free = [], [], [6 * GIB]

    def timer(fn, reps):
        timed.append(reps)
        fn()
        return 1e-3  # 1 ms per call

    def release():  # the probes' buffers go back; what cuBLAS keeps does not
        free[0] -= 64 * MIB

    def stream_workspace():  # a second stream's GEMM keeps its workspace: after usable VRAM is read
        free[0] -= 32 * MIB
        return 32 * MIB

    gpu, link = measure_gpu(torch.device("cpu"), name="Mock GPU", mem_get_info=lambda: (free[0], 8 * GIB),
                            sync=lambda: syncs.append(1), pin_memory=False, quick=True,
                            copy_bytes=8 * MIB, link_bytes=4 * MIB, hidden=128, timer=timer, release=release,
                            stream_workspace=stream_workspace, flash_attention=lambda: True)
    # usable VRAM as read after the probes, and before the second stream's workspace
    assert (gpu.name, gpu.vram_total_bytes, gpu.vram_usable_bytes, gpu.cuda_context_reserve_bytes) == \
        ("Mock GPU", 8 * GIB, 6 * GIB - 64 * MIB, 2 * GIB + 64 * MIB)
    assert gpu.stream_workspace_bytes == 32 * MIB and gpu.flash_attention is True
    # HBM: the device copy (read + written) timed by the device timer too (1 ms a call), 3 runs
    assert timed[:3] == [10, 10, 10] and len(gpu.hbm_gibps_runs) == 3
    assert gpu.hbm_gibps == pytest.approx(2 * 8 * MIB / 1e-3 / GIB, rel=1e-3)
    # the prefill rate: the executor's prompt-chunk shape, timed by the device timer
    assert timed[3:6] == [10, 10, 10] and gpu.prefill_gflops == pytest.approx(2 * 512 * 128 * 128 / 1e-3 / 1e9, rel=1e-3)
    # the decode projection as the GPU stage runs it: a (3·H, H) bf16 weight read per 1 ms call
    assert timed[6:] == [10, 10, 10] and gpu.gemv_gibps == pytest.approx(3 * 128 * 128 * 2 / 1e-3 / GIB, rel=1e-3)
    assert gpu.prefill_matmul == "(512,128)x(128,128) bfloat16"
    assert link.h2d_gibps > 0 and link.d2h_gibps > 0 and link.h2d_latency_us > 0 and not link.pinned
    assert len(syncs) > 100                     # every timed region is synchronised


TINY_BLOCK = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
              "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 1, "vocab_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "rope_theta": 1e6, "torch_dtype": "float32"}


def _mock_gpu(timer, decode_block, said):
    return measure_gpu(torch.device("cpu"), name="Mock GPU", mem_get_info=lambda: (GIB, 2 * GIB),
                       sync=lambda: None, pin_memory=False, quick=True, copy_bytes=4 * MIB, link_bytes=MIB,
                       hidden=64, timer=timer, matmul_dtype=torch.bfloat16, decode_block=decode_block,
                       progress=said.append)[0]


def test_the_gpus_delta_is_its_decode_blocks_time_beyond_the_roofline(monkeypatch):
    """The profile prices the GPU stage's per-block overhead δ as what the executor's decode step
    takes per block beyond the block's roofline: the DESIGN §5 formulas for one token at the
    probe's context, at the rates this profile measured."""
    from executor import device_probe
    timed = []
    monkeypatch.setattr(device_probe, "decode_block_ms",
                        lambda device, timer, reps, config: (timed.append(config["torch_dtype"]), (50.0, "mock run"))[1])
    said = []
    gpu = _mock_gpu(lambda fn, reps: (fn(), 1e-3)[1], TINY_BLOCK, said)
    assert timed == ["bfloat16"]                                 # the block in the GPU's matmul dtype
    H, I, h, kv, d, c = 128, 384, 4, 2, 32, device_probe.DECODE_BLOCK_CONTEXT
    params = H * (h + 2 * kv) * d + h * d * H + 3 * H * I
    f_proj, w = 2 * params, 2 * (params + 2 * H + 2 * d)         # bf16 weights, the norms' too
    f_attn, kv_bytes = 4 * h * c * d, 2 * 2 * kv * d * c
    P, Mw, M = gpu.prefill_gflops * 1e9, gpu.gemv_gibps * GIB, gpu.hbm_gibps * GIB
    roofline_ms = 1e3 * (max(f_proj / P, w / Mw) + max(f_attn / P, kv_bytes / M))
    assert gpu.decode_block_ms == 50.0 and gpu.decode_block_roofline_ms == pytest.approx(roofline_ms, rel=1e-3)
    assert gpu.decode_block == ("Qwen3ForCausalLM block (hidden 128, MLP 384, 4/2 heads of 32) bfloat16, "
                                f"one token at context {c}, mock run")
    assert 0 < roofline_ms < 50   # δ is stored to 3 significant digits
    assert profiled_gpu_delta_ms(gpu) == pytest.approx(50.0 - roofline_ms, rel=2e-3)
    assert any(m.startswith("decode block: 50000.0 us a block") for m in said)


def test_a_decode_block_no_slower_than_the_roofline_or_not_measured_prices_no_delta():
    from dataclasses import replace
    said = []
    # a timer that gives every call the same time: the deeper stage is no slower, nothing measured
    gpu = _mock_gpu(lambda fn, reps: (fn(), 1e-3)[1], TINY_BLOCK, said)
    assert (gpu.decode_block_ms, gpu.decode_block_roofline_ms, gpu.decode_block) == (None, None, None)
    assert profiled_gpu_delta_ms(gpu) is None and any("decode block: not measured" in m for m in said)
    assert profiled_gpu_delta_ms(None) is None
    fast = replace(gpu, decode_block_ms=0.1, decode_block_roofline_ms=0.12, decode_block="mock")
    assert profiled_gpu_delta_ms(fast) == 0.0


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 96 MiB"),
                                   RuntimeError("CUDA graph capture of the GPU stage's decode step failed\nat 1 x 2")])
def test_a_gpu_whose_decode_block_cannot_run_is_profiled_without_it(monkeypatch, error):
    """Out of memory (a GPU busy with others) or a failed capture: the profile goes on, the
    plans price no δ for the GPU, and the progress says why in one line."""
    from executor import device_probe

    def fails(*args):
        raise error

    monkeypatch.setattr(device_probe, "decode_block_ms", fails)
    said = []
    gpu = _mock_gpu(lambda fn, reps: (fn(), 1e-3)[1], TINY_BLOCK, said)
    assert gpu.decode_block_ms is None and gpu.gemv_gibps > 0 and profiled_gpu_delta_ms(gpu) is None
    why = [m for m in said if m.startswith("decode block: not measured")]
    assert len(why) == 1 and type(error).__name__ in why[0] and str(error).splitlines()[0] in why[0]


def test_a_profile_with_a_gpu_plans_a_split(dev_machine):
    def fake_probe(quick, progress):
        return measure_gpu(torch.device("cpu"), name="Mock GPU", mem_get_info=lambda: (GIB, 2 * GIB),
                           sync=lambda: None, pin_memory=False, quick=True, copy_bytes=4 * MIB,
                           link_bytes=MIB, hidden=64)
    from dataclasses import replace
    gpu, link = fake_probe(True, None)
    m = replace(dev_machine, gpu=replace(gpu, hbm_gibps=100.0, gemv_gibps=90.0, prefill_gflops=1e4),
                link=link)  # faster than the CPU
    p = make_plan(config_path("qwen3-1.7b"), m)
    assert 0 < p.partition.split_k < p.partition.num_units     # 3.2 GiB of weights, 1 GiB of VRAM
    assert p.limits.gpu_budget_bytes == GIB


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_probe_without_cuda_returns_none():
    said = []
    assert probe_cuda(True, said.append) is None and "no CUDA" in said[0]


def test_checked_in_dev_profile_was_measured_here():
    m = load_machine(DEV)
    assert m.source == "measured" and not m.quick and m.gpu is None
    assert len(m.cpu.dram_read_gibps_runs) == 7 and m.cpu.dram_buffer_bytes >= 2 * GIB
    assert m.cpu.l3_read_source == "measured"


def test_a_busy_machine_or_probes_that_disagree_are_warned_about(monkeypatch):
    """A shared machine's profile is what other work leaves (two back-to-back quick profiles here
    read the bf16 GEMV at 2.6 and 40 GiB/s): the profile says so, rather than handing a plan
    figures off by 15x with full confidence."""
    from types import SimpleNamespace

    from planner import profile

    monkeypatch.setattr(profile.os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    assert "busy (load average 3.00 for 2 threads)" in profile._busy(2)
    assert profile._busy(8) is None
    kernels = SimpleNamespace(dtypes=(SimpleNamespace(dtype="bfloat16", gemv_gibps=2.6),
                                      SimpleNamespace(dtype="float32", gemv_gibps=19.0)))
    found = profile._disagreements(20.0, [19.0, 20.0, 21.0], kernels)
    assert len(found) == 1 and "bfloat16 decode GEMV read 2.6 GiB/s" in found[0]
    assert "DRAM runs disagree" in profile._disagreements(20.0, [8.0, 20.0, 21.0], None)[0]
    assert profile._disagreements(20.0, [19.0, 20.0, 21.0], None) == []
