"""tools/bench_gpu.py's code paths, on a tiny model on any machine (--smoke): the benchmark itself
needs a GPU and runs on a lent one (tools/gpu_run.sh); this keeps it from rotting in between."""
from __future__ import annotations

import json

from tools import bench_gpu


def test_the_gpu_benchmark_runs_end_to_end_in_smoke_mode(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    from planner.machine import DeviceCalibration

    placeholder = bench_gpu.placeholder_machine
    # a profile that timed the GPU's one-token matmul and a decode block (as a measured one has):
    # the matmul's rate is reported too, and the block's δ that the plans carry (a small one: the
    # tiny model's blocks are so cheap on the CPU that a real GPU's δ would rightly keep them there)
    def measured_like():
        m = placeholder()
        return replace(m, gpu=replace(m.gpu, gemv_gibps=400.0, decode_block_ms=0.151, decode_block_roofline_ms=0.15,
                                      decode_block="mock block", flash_attention=True),
                       calibration=replace(m.calibration, cuda=DeviceCalibration(delta_ms_per_block=0.001)))

    monkeypatch.setattr(bench_gpu, "placeholder_machine", measured_like)
    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--smoke", "--work", str(tmp_path / "work"), "--new-tokens", "24", "--prompt-tokens", "8",
                           "--context", "64", "--compiled", "--paged-decode", "--long-prompt-tokens", "40", "--split", "3",
                           "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["smoke"] and results["model"] == "tiny"
    helm = results["capped"]["helm"]
    assert helm["decode_tok_s"] > 0 and {r["phase"] for r in helm["stages"]} == {"prefill", "decode"}
    assert helm["decode_ms_per_token_recorded"] > 0        # the same request with the Recorder's predictions
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in helm["stages"])
    assert helm["decode_path"] == "static step, eager"  # the GPU stage's code, on the CPU
    # run 1 at split 3: two blocks on the CPU, whose prompt steps the plan streams from some size
    # on (flash attention runs on the profile's GPU): TTFT streamed and not, at both prompts
    assert helm["split_k"] == 3
    streamed = helm["streamed_prefill"]
    assert 1 <= streamed["stream_prefill_min_rows"] <= 40
    assert {k for k in streamed if k.startswith("prompt_")} == {"prompt_8", "prompt_40"}
    assert all(t["streamed_ms"] > 0 and t["streamed_in_chunks_ms"] > 0 and t["cpu_ms"] > 0
               and t["predicted_streamed_ms"] > 0 for k, t in streamed.items() if k.startswith("prompt_"))
    assert streamed["stream_prefill_step_tokens"] >= 8  # the plan's: at least a prompt chunk (of its context)
    fit = helm["after_fit"]  # fitted to this request, checked on another
    assert fit["prompt_tokens"] == 8 and {r["phase"] for r in fit["stages"]} == {"prefill", "decode"}
    assert results["all_gpu"]["split_k"] == 0 and results["all_gpu"]["hbm_roofline_ms"] > 0
    # the weights at half the placeholder's HBM rate (800 GiB/s), the KV as before
    assert results["all_gpu"]["projection_rate_ms"] > results["all_gpu"]["hbm_roofline_ms"]
    # where a decode step's time goes (on the CPU here: its ops)
    profile = results["all_gpu"]["decode_profile"]
    assert profile["ops_per_step"] > 10 and 0 < profile["busy_ms_per_step"] and profile["top"]
    assert profile["wall_ms_per_step"] > 0 and all(t["ms_per_step"] >= 0 for t in profile["top"])
    # run 2 again with the blocks' halves compiled (on the CPU: Inductor's C++), the same tokens' speed reported
    compiled = results["all_gpu_compiled"]
    assert compiled["compiled"] and not results["all_gpu"]["compiled"]
    assert compiled["decode_ms_per_token"] > 0 and compiled["vs_uncompiled"] > 0 and compiled["decode_profile"]["top"]
    # run 2 again with the paged decode kernels (on the CPU: under Triton's interpreter) where Triton is here
    paged = results["all_gpu_paged_decode"]
    from executor import paged_decode
    assert paged["paged_decode"] == (paged_decode.triton is not None) and not results["all_gpu"]["paged_decode"]
    assert paged["decode_ms_per_token"] > 0 and paged["vs_sdpa"] > 0
    assert results["profile_decode_block"] == {"block": "mock block", "ms": 0.151, "roofline_ms": 0.15,
                                               "delta_ms_per_block": 0.001}
    # the targets it measured, each with its figure and bound (the smoke run's figures mean nothing)
    t = results["targets"]
    assert set(t) >= {"all_gpu_over_roofline", "all_gpu_compiled_over_roofline", "gpu_stage_predicted_first_plan",
                      "gpu_stage_predicted_after_fit", "all_gpu_stage_predicted_first_plan"}
    assert "decode_vs_accelerate_at_cap" not in t           # no Accelerate in a smoke run
    assert t["all_gpu_over_roofline"]["value"] == results["all_gpu"]["over_roofline"]
    assert t["all_gpu_over_roofline"]["verdict"] == ("met" if results["all_gpu"]["over_roofline"] <= 1.25 else "missed")
    worst = max((r["error_pct"] for r in helm["stages"] if r["device"] == "cuda" and r["phase"] == "decode"), key=abs)
    assert t["gpu_stage_predicted_first_plan"]["value"] == worst
    err = capsys.readouterr().err
    assert "capped at" in err and "all-GPU, compiled" in err
    assert "target all_gpu_over_roofline: " in err
    assert "profile: a decode block 0.151 ms, roofline 0.15 ms: δ 0.001 ms per block (mock block)" in err


def test_the_targets_verdicts_follow_their_bounds():
    rows = [{"device": "cpu", "phase": "decode", "error_pct": 40.0},
            {"device": "cuda", "phase": "decode", "error_pct": -12.5},
            {"device": "cuda", "phase": "prefill", "error_pct": 30.0}]
    results = {"capped": {"decode_speedup": 3.4, "helm": {"stages": rows, "after_fit": {"stages": [
        {"device": "cuda", "phase": "decode", "error_pct": 4.0}]}}},
        "all_gpu": {"over_roofline": 1.31, "stages": []}}
    t = bench_gpu.targets(results)
    assert t["decode_vs_accelerate_at_cap"] == {"value": 3.4, "bound": ">= 3.0x", "verdict": "met"}
    assert t["all_gpu_over_roofline"]["verdict"] == "missed"
    # the GPU stage's decode rows only, the worst of them
    assert t["gpu_stage_predicted_first_plan"] == {"value": -12.5, "bound": "|error| <= 10.0%", "verdict": "missed"}
    assert t["gpu_stage_predicted_after_fit"]["verdict"] == "met"
    assert "all_gpu_stage_predicted_first_plan" not in t and "all_gpu_compiled_over_roofline" not in t


def test_a_run_that_raises_is_recorded_and_the_runs_after_it_go_on(tmp_path, capsys, monkeypatch):
    """On a lent GPU a run that fails (a torch.compile or a capture never tried on that torch)
    must not take the runs after it down: its error is recorded, the next run measures. A run
    whose decode step fell back from what it was to measure (the paged kernels) is marked
    invalid and scores no target."""
    import os

    from executor import paged_decode

    run_helm = bench_gpu.run_helm

    def compiled_fails(*args, **kwargs):
        if os.environ.get(bench_gpu.COMPILE_ENV) == "1":
            raise RuntimeError("compile failed for the test")
        return run_helm(*args, **kwargs)

    monkeypatch.setattr(bench_gpu, "run_helm", compiled_fails)
    # the paged run's step falls back to SDPA, as where Triton cannot be imported
    monkeypatch.setattr(paged_decode, "triton", None)
    monkeypatch.setattr(paged_decode, "_NO_TRITON", "no Triton, for the test", raising=False)
    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--smoke", "--work", str(tmp_path / "work"), "--new-tokens", "6", "--prompt-tokens", "8",
                           "--context", "32", "--skip-capped", "--compiled", "--paged-decode", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert "compile failed for the test" in results["all_gpu_compiled"]["error"]
    assert results["all_gpu_compiled"]["traceback"]
    paged = results["all_gpu_paged_decode"]
    assert paged["decode_ms_per_token"] > 0 and not paged["paged_decode"] and "paged decode" in paged["invalid"]
    assert "vs_sdpa" not in paged and "all_gpu_paged_decode_over_roofline" not in results["targets"]
    assert "all_gpu_over_roofline" in results["targets"]
    err = capsys.readouterr().err
    assert "all_gpu_compiled failed: RuntimeError: compile failed for the test" in err and "INVALID" in err


def test_skip_all_gpu_runs_the_capped_run_alone(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--smoke", "--work", str(tmp_path / "work"), "--new-tokens", "6", "--prompt-tokens", "8",
                           "--long-prompt-tokens", "16", "--skip-all-gpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["capped"]["helm"]["decode_tok_s"] > 0
    assert not any(k.startswith("all_gpu") for k in results)


def test_the_cap_target_is_what_the_allocator_held_over_the_cap():
    """capped_peak_reserved_within_cap: CUDA's peak reserved bytes while HELM served the plan
    made for the cap, over the cap."""
    gib = 1 << 30
    held = {"capped": {"helm": {"stages": [], "gpu_memory": {"peak_reserved_bytes": 7 * gib}}},
            "gpu_memory_cap_bytes": 8 * gib}
    assert bench_gpu.targets(held)["capped_peak_reserved_within_cap"] == {
        "value": 0.875, "bound": "<= 1.0", "verdict": "met"}
    held["capped"]["helm"]["gpu_memory"]["peak_reserved_bytes"] = 9 * gib
    assert bench_gpu.targets(held)["capped_peak_reserved_within_cap"]["verdict"] == "missed"
    invalid = {"all_gpu_paged_decode": {"over_roofline": 1.1, "invalid": "fell back"}}
    assert "all_gpu_paged_decode_over_roofline" not in bench_gpu.targets(invalid)
