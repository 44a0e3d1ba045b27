"""Machine profiling. The CPU path runs for real; the GPU path runs the same code on CPU tensors
with a mocked memory query (no GPU here), so CUDA specifics are not exercised."""
from __future__ import annotations

import time

import pytest
import torch

from planner.machine import load_machine, machine_to_yaml
from planner.planning import make_plan
from planner.profile import (ISA_FLAGS, detect_cpu_facts, measure_gpu, measure_read_bandwidth, probe_cuda,
                             profile_machine)
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
    m = profile_machine(quick=True, name="test-box", progress=messages.append, gpu_probe=lambda q, p: None)
    # ~9 s on an idle 2-core VM, most of it the kernels probe (27 s once beside another test run):
    # a bound against the quick profile turning into a full one, not a timing
    assert time.perf_counter() - start < 60
    assert torch.get_num_threads() == threads                  # measured with all cores, then restored
    assert m.source == "measured" and m.quick and m.name == "test-box" and m.gpu is None
    # the bandwidth buffer dwarfs the L3 (else it measures the cache)
    assert m.cpu.dram_buffer_bytes >= max(GIB, 3 * m.cpu.l3_bytes)
    assert len(m.cpu.dram_read_gibps_runs) == 3 and m.cpu.dram_read_gibps > 0 and m.cpu.compute_gflops > 0
    assert m.cpu.l3_read_source.startswith("estimated")
    assert any("DRAM read" in msg and "run 3/3" in msg for msg in messages)
    # the attention kernel's cold KV rate, relative to DRAM's, is the plans' default η_kv
    assert any("KV read (attention kernel)" in msg and "run 3/3" in msg for msg in messages)
    assert m.calibration.provenance == "profiled" and 0 < m.calibration.cpu.eta_kv <= 1
    assert m.calibration.cuda.eta_kv == 1.0
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
    assert gpu.hbm_gibps > 0 and len(gpu.hbm_gibps_runs) == 3
    # the prefill rate: the executor's prompt-chunk shape, timed by the device timer (1 ms a call)
    assert timed[:3] == [10, 10, 10] and gpu.prefill_gflops == pytest.approx(2 * 512 * 128 * 128 / 1e-3 / 1e9, rel=1e-3)
    # the decode projection as the GPU stage runs it: a (3·H, H) bf16 weight read per 1 ms call
    assert timed[3:] == [10, 10, 10] and gpu.gemv_gibps == pytest.approx(3 * 128 * 128 * 2 / 1e-3 / GIB, rel=1e-3)
    assert gpu.prefill_matmul == "(512,128)x(128,128) bfloat16"
    assert link.h2d_gibps > 0 and link.d2h_gibps > 0 and link.h2d_latency_us > 0 and not link.pinned
    assert len(syncs) > 100                     # every timed region is synchronised


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
