"""Synthetic units and machines for cost-model and search tests (no tracing)."""
from __future__ import annotations

from dataclasses import replace

from planner.machine import (Calibration, CpuProfile, DeviceCalibration, GpuProfile, LinkProfile,
                             MachineProfile)
from planner.ir import SharedWeight, UnitIR
from planner.units import GIB, MIB


def unit(i: int, kind: str, weight_bytes: int, *, kv: int = 0, act: int = 8192, proj: int | None = None,
         attn: int = 0, read: int | None = None) -> UnitIR:
    return UnitIR(index=i, kind=kind, weights=(f"u{i}",), weight_bytes=weight_bytes,
                  read_bytes_per_token=weight_bytes if read is None else read, act_bytes_per_token=act,
                  kv_bytes_per_token=kv, proj_flops_per_token=weight_bytes if proj is None else proj,
                  attn_flops_per_context_token=attn, num_nodes=1, traced_as=i)


def model_units(num_blocks: int, block_bytes: int, emb_bytes: int, head_bytes: int, kv: int = 4096,
                act: int = 8192, attn: int = 16384, tied: bool = False):
    """(units, shared): embedding, num_blocks identical blocks, head."""
    units = [unit(0, "embedding", emb_bytes, read=min(emb_bytes, act), proj=0, act=act)]
    units += [unit(i, "block", block_bytes, kv=kv, act=act, attn=attn) for i in range(1, num_blocks + 1)]
    units.append(unit(num_blocks + 1, "head", head_bytes, act=act))
    shared = (SharedWeight("embed.weight", emb_bytes, (0, num_blocks + 1)),) if tied else ()
    return tuple(units), shared


def machine(*, cpu_gibps: float = 10.0, cpu_gflops: float = 100.0, l3_bytes: int = 32 * MIB,
            l3_gibps: float = 30.0, ram_bytes: int = 64 * GIB, gpu: bool = True, hbm_gibps: float = 100.0,
            gpu_gflops: float = 10000.0, vram_usable: int = 8 * GIB, link_gibps: float = 10.0,
            latency_us: float = 10.0, delta_cpu: float = 0.0, delta_gpu: float = 0.0,
            flash_attention: bool | None = None) -> MachineProfile:
    cpu = CpuProfile(model_name="test cpu", cores=4, threads=8, isa=("avx2",), l3_bytes=l3_bytes,
                     dram_read_gibps=cpu_gibps, dram_read_gibps_runs=(), dram_buffer_bytes=0,
                     l3_read_gibps=l3_gibps, l3_read_source="manual", compute_gflops=cpu_gflops,
                     ram_total_bytes=ram_bytes, ram_available_bytes=ram_bytes)
    g = GpuProfile(name="test gpu", vram_total_bytes=vram_usable + GIB, vram_usable_bytes=vram_usable,
                   cuda_context_reserve_bytes=GIB, hbm_gibps=hbm_gibps, hbm_gibps_runs=(),
                   prefill_gflops=gpu_gflops, prefill_matmul="test", flash_attention=flash_attention)
    link = LinkProfile(h2d_gibps=link_gibps, d2h_gibps=link_gibps, h2d_latency_us=latency_us,
                       d2h_latency_us=latency_us, pinned=True)
    cal = Calibration(cpu=DeviceCalibration(delta_ms_per_block=delta_cpu),
                      cuda=DeviceCalibration(delta_ms_per_block=delta_gpu))
    return MachineProfile(kind="machine_profile", schema_version=1, name="test", source="manual", notes="",
                          tool_version="test", measured_at=None, profile_seconds=None, quick=False, cpu=cpu,
                          gpu=g if gpu else None, link=link if gpu else None, calibration=cal)


def with_vram(m: MachineProfile, usable: int) -> MachineProfile:
    return replace(m, gpu=replace(m.gpu, vram_usable_bytes=usable, vram_total_bytes=usable + GIB))
