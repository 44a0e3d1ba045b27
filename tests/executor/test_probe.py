"""executor/probe.py: the measurements the profile records and the routes the executor takes.
Rates are whatever this machine gives; what is checked is that the choice follows them and that
the result is what the machine profile's schema and the kernels accept."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from executor.backends import resolve_backend

pytestmark = pytest.mark.skipif(resolve_backend("auto") != "helm", reason="CPU kernels not built")


def test_gemm_route_is_the_fastest_candidate_and_its_crossover():
    from executor import kernels
    from executor.probe import CROSSOVER_ROWS, PROBE_ROWS, gemm_route

    route = gemm_route(torch.bfloat16, threads=2, quick=True, shape=(512, 256))
    assert set(route["candidates"]) == set(kernels.PROMPT_PATHS)
    # fp16 never goes to PyTorch's fp16 GEMM (its fp16 result can overflow)
    assert "torch" not in gemm_route(torch.float16, threads=1, quick=True, shape=(64, 64))["candidates"]
    assert route["path"] == max(route["candidates"], key=route["candidates"].get)
    assert route["gflops"] == route["candidates"][route["path"]]
    if route["path"] == "gemv":
        assert route["min_rows"] == kernels.MAX_TILE_B + 1
    else:
        assert route["min_rows"] in (*CROSSOVER_ROWS, PROBE_ROWS)
    fp32 = gemm_route(torch.float32, threads=1, quick=True, shape=(64, 64))
    assert "torch_fp32" not in fp32["candidates"]  # for fp32 weights it is the "torch" call


def test_candidates_are_timed_in_turns_and_each_keeps_its_best(monkeypatch):
    """A burst of other work must slow one round of every candidate, not all of one candidate's
    runs: the calls alternate after one warm-up each, and each candidate's best call is kept."""
    from executor import probe

    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(probe, "time", SimpleNamespace(perf_counter=lambda: next(clock) * 1.0))  # probe's own
    cost = {"a": [5, 1, 3], "b": [2, 4, 9]}  # each timed call's seconds, in the order they are called

    def timed(name):
        def call():
            calls.append(name)
            if len(calls) > 2:  # past the warm-ups: the clock advances by the call's cost
                for _ in range(cost[name].pop(0) - 1):
                    next(clock)
        return call

    best = probe._best_seconds_each({"a": timed("a"), "b": timed("b")}, reps=3)
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert best == {"a": 1.0, "b": 2.0}


def test_probe_rows_fill_a_valid_machine_profile_and_give_kernel_routes():
    from executor import kernels
    from executor.probe import gemm_routes, probe_cpu_kernels
    from planner.machine import load_machine, machine_to_yaml
    from planner.profile import placeholder_machine
    from planner.serial import from_dict
    from planner.machine import CpuKernels

    messages = []
    measured = probe_cpu_kernels(["float16"], threads=2, quick=True, buffer_bytes=64 << 20,
                                 progress=messages.append)
    assert measured["isa"] == kernels.KERNEL_ISA and measured["fma_peak_gflops"] > 0
    (row,) = measured["dtypes"]
    assert row["dtype"] == "float16" and row["gemv_gibps"] > 0 and row["attention_gflops"] > 0
    assert [p["rows"] for p in row["prompt_gflops"]] == [128, 512] and all(p["gflops"] > 0 for p in row["prompt_gflops"])
    from executor.probe import CROSSOVER_QUERIES
    assert row["attention_kernel_max_queries"] in (1, *CROSSOVER_QUERIES)
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


@pytest.mark.parametrize("same_kernels", [True, False], ids=["measured-here", "measured-elsewhere"])
def test_the_plan_routes_the_prompt_gemms_where_measured_with_these_kernels(checkpoint, tmp_path, same_kernels):
    """A plan whose profile measured the kernels with this ISA and thread count routes the
    prompt GEMMs its way; one measured with another ISA is re-measured at load instead."""
    from executor import kernels
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.placement import usable_cpus
    from executor.plan_io import placement_from_plan
    from planner.machine import CpuKernels, KernelRates, PromptRate
    from planner.profile import placeholder_machine
    from planner.plan import save_plan
    from planner.planning import plan_for_split

    path = checkpoint("qwen3", "bf16")
    cfg = ModelConfig.from_dir(path)
    isa = kernels.KERNEL_ISA if same_kernels else next(i for i in kernels.ISAS if i != kernels.KERNEL_ISA)
    rates = KernelRates(dtype="bfloat16", gemv_gibps=20.0, gemm_path="torch_fp32", gemm_min_rows=20,
                        gemm_gflops=100.0, gemm_candidates={"torch_fp32": 100.0},
                        prompt_gflops=(PromptRate(512, 90.0),), attention_gflops=50.0,
                        attention_kernel_max_queries=3)
    m = placeholder_machine()
    threads = min(2, usable_cpus())
    m = replace(m, cpu=replace(m.cpu, kernels=CpuKernels(isa=isa, threads=threads, fma_peak_gflops=100.0,
                                                          dtypes=(rates,))))
    plan_path = tmp_path / "plan.yaml"
    save_plan(plan_for_split(path, cfg.num_units, machine=m), plan_path)
    placement = placement_from_plan(plan_path, path, cfg, cpu_threads=threads)
    model = load_model(path, placement, cfg, backend="helm")
    routes = model.stages[0].ops.kernel_set.routes
    max_queries = model.stages[0].attention.max_queries
    if same_kernels:
        assert routes == {torch.bfloat16: ("torch_fp32", 20)} and max_queries == 3
    else:  # measured now: 20 rows and 3 queries are no crossovers the probe can find
        assert routes != {torch.bfloat16: ("torch_fp32", 20)} and max_queries != 3
