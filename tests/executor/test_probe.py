"""executor/probe.py: the measurements the profile records and the routes the executor takes.
Rates are whatever this machine gives; what is checked is that the choice follows them and that
the result is what the machine profile's schema and the kernels accept."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from executor.backends import resolve_backend

pytestmark = pytest.mark.skipif(resolve_backend("auto") != "helm", reason="CPU kernels not built")


def test_gemm_route_is_the_fastest_candidate_and_its_crossover():
    from executor import kernels
    from executor.probe import CROSSOVER_ROWS, PROBE_ROWS, gemm_route

    route = gemm_route(torch.bfloat16, threads=2, quick=True, shape=(512, 256))
    assert set(route["candidates"]) == set(kernels.PROMPT_PATHS)
    assert route["path"] == max(route["candidates"], key=route["candidates"].get)
    assert route["gflops"] == route["candidates"][route["path"]]
    if route["path"] == "gemv":
        assert route["min_rows"] == kernels.MAX_TILE_B + 1
    else:
        assert route["min_rows"] in (*CROSSOVER_ROWS, PROBE_ROWS)
    fp32 = gemm_route(torch.float32, threads=1, quick=True, shape=(64, 64))
    assert "torch_fp32" not in fp32["candidates"]  # for fp32 weights it is the "torch" call


def test_probe_rows_fill_a_valid_machine_profile_and_give_kernel_routes():
    from executor import kernels
    from executor.probe import gemm_routes, probe_cpu_kernels
    from planner.machine import load_machine, machine_to_yaml, placeholder_machine
    from planner.serial import from_dict
    from planner.machine import CpuKernels

    messages = []
    measured = probe_cpu_kernels(["float16"], threads=2, quick=True, buffer_bytes=64 << 20,
                                 progress=messages.append)
    assert measured["isa"] == kernels.KERNEL_ISA and measured["fma_peak_gflops"] > 0
    (row,) = measured["dtypes"]
    assert row["dtype"] == "float16" and row["gemv_gibps"] > 0 and row["attention_gflops"] > 0
    assert [p["rows"] for p in row["prompt_gflops"]] == [128, 512] and all(p["gflops"] > 0 for p in row["prompt_gflops"])
    assert any("prompt GEMM" in m for m in messages)
    m = placeholder_machine()
    m = replace(m, cpu=replace(m.cpu, kernels=from_dict(CpuKernels, measured)))
    assert load_machine(machine_to_yaml(m)) == m  # schema-valid and round-trips
    routes = gemm_routes(m.cpu.kernels.dtypes)
    if row["gemm_path"] == "gemv":
        assert routes == {}
    else:
        assert routes == {torch.float16: (row["gemm_path"], row["gemm_min_rows"])}
        ks = kernels.KernelSet(kernels.KERNEL_ISA, routes)
        assert ks.path(torch.float16, row["gemm_min_rows"]) == row["gemm_path"]
        assert ks.path(torch.float16, row["gemm_min_rows"] - 1) == "gemv"
