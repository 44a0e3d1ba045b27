"""Benchmark: the GPU stage (issue 11). Two runs, side by side in one process, on a random-weight
checkpoint with a real model's dimensions (default Qwen3-8B, bf16):

1. The GPU capped (default 8 GiB, the RTX 4060 case): HELM's plan for that cap (the search picks
   k) against Hugging Face Accelerate's `device_map="auto"` with `max_memory={0: cap, "cpu": ...}`,
   the same prompt and new tokens, greedy: decode tok/s, TTFT, and HELM's measured vs predicted
   time per stage; where the plan streams the CPU stage's prompt steps to the GPU, their TTFT
   streamed in the plan's steps, streamed in 512-token chunks, and on the CPU, in turns, at the
   prompt and at --long-prompt-tokens.
   Then δ and the η factors are fitted to that request's report and a second request, of another
   length, is measured against the fitted plan (the fit's error out of sample).
2. All on the GPU (split 0): decode ms/token at the context against the HBM roofline, the bytes a
   step reads (weights + KV, from the plan's IR) over the HBM bandwidth the profile measured; with
   the decode steps as CUDA graphs (the default) and eagerly.
3. With --compiled, run 2 again with each block's halves around attention compiled by
   torch.compile (HELM_COMPILE=1, executor/device_step.py), as CUDA graphs: its load (compiles
   and captures), decode ms/token and kernels per step beside run 2's.

The machine is profiled first (`helm-plan profile --quick`), so the plans price this machine.

    python tools/bench_gpu.py                                    # Qwen3-8B dims, 8 GiB cap
    python tools/bench_gpu.py --size qwen3-1.7b --gpu-memory 2GiB --new-tokens 16
    python tools/bench_gpu.py --skip-capped --compiled           # run 2, and run 3 beside it
    python tools/bench_gpu.py --smoke                            # tiny model, any machine: the code paths

Without CUDA (or with --smoke) it runs the tiny model on the CPU with a placeholder profile and
leaves Accelerate out: a check that the script works, not a benchmark.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python tools/bench_gpu.py`
    sys.path.insert(0, str(REPO))

from executor.device_step import COMPILE_ENV, PAGED_DECODE_ENV, ResidentDecode, ready_profiler_for_graphs  # noqa: E402
from executor.engine import Engine  # noqa: E402
from executor.loader import load_model  # noqa: E402
from executor.model_config import ModelConfig  # noqa: E402
from executor.plan_io import placement_for, plan_gpu_bytes  # noqa: E402
from executor.report import Recorder, kernel_isa  # noqa: E402
from executor.request_params import SamplingParams, StopCriteria  # noqa: E402
from planner.calibrate import recalibrate  # noqa: E402
from planner.cost import weight_read_bytes  # noqa: E402
from planner.errors import PlanError  # noqa: E402
from planner.machine import load_machine, save_machine  # noqa: E402
from planner.planning import make_plan, replan, workload_for  # noqa: E402
from planner.predict import predict_ttft_ms  # noqa: E402
from planner.profile import placeholder_machine, profile_machine, stderr_progress  # noqa: E402
from planner.units import GIB, fmt_bytes, parse_bytes  # noqa: E402
from tools.make_model import make_model  # noqa: E402


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 30000), (n,), generator=g).tolist()


def _request(engine: Engine, recorder: Recorder | None, ids: list[int], new_tokens: int):
    """One greedy request alone on the engine, its steps recorded against `recorder`'s plan."""
    if recorder is not None:
        recorder.attach(engine)
    seq = engine.add_request(ids, SamplingParams(), StopCriteria(max_new_tokens=new_tokens, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.on_step = engine.on_launched = None
    return seq


def _stage_rows(recorder: Recorder) -> list[dict]:
    return [{"stage": r.stage, "device": r.device, "phase": r.phase, "streamed": bool(r.streamed),
             "steps": r.samples, "measured_ms": round(r.measured_mean_ms, 3), "predicted_ms": round(r.predicted_ms, 3),
             "error_pct": round(r.error_pct, 1)} for r in recorder.report().rows]


def _gpu_memory(plan, model, after_load: int) -> dict:
    """What the plan priced for the GPU stage (planner/working_set.py) against what CUDA's
    allocator held: the working set measured is the peak beyond the stage's weights and its KV
    pages (the slab's scratch slot, the decode graphs' pool and every step's temporaries)."""
    stage, kv = next(s for s in plan.partition.stages if s.device == "cuda"), model.stages[-1].kv
    pool = kv.device_pool if kv is not None else None
    pages = pool.capacity_pages * pool.page_bytes if pool is not None and pool.capacity_pages else 0
    peak = torch.cuda.max_memory_allocated()
    measured = peak - stage.weight_bytes - pages
    priced = stage.working_bytes or 0
    return {"plan_gpu_bytes": fmt_bytes(plan_gpu_bytes(plan)),
            "after_load": fmt_bytes(after_load), "peak_allocated": fmt_bytes(peak),
            "peak_reserved": fmt_bytes(torch.cuda.max_memory_reserved()),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "plan_working_set": fmt_bytes(priced), "working_set": fmt_bytes(measured),
            "working_set_over_plan": round(measured / priced, 3) if priced else None}


def decode_profile(engine: Engine, ids: list[int], steps: int = 8) -> dict:
    """Where a decode step's time goes: `steps` steps of one greedy request, after its prompt,
    under PyTorch's profiler. On CUDA: kernels a step launches (graph replays included) and the
    time they run, against the step's wall time: a busy fraction well below 1 means the step is
    bound by launches and host work, not by HBM. Elsewhere (smoke) the same over CPU ops."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    seq = engine.add_request(ids, SamplingParams(), StopCriteria(max_new_tokens=steps + 2, ignore_eos=True))
    while not seq.output_ids:  # the prompt, and the first token it gives
        engine.step()
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    wall = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    per_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == kind:
            us = e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
            per_name.setdefault(e.name[:80], []).append(us)
    busy = sum(sum(v) for v in per_name.values()) / 1e3 / steps
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    if not per_name:  # a profiler that traces no kernel inside graph replays: nothing below means anything
        return {"steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 3),
                "note": "the profiler saw no " + ("kernels" if cuda else "ops")}
    return {"steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 3),
            ("kernels" if cuda else "ops") + "_per_step": round(sum(len(v) for v in per_name.values()) / steps, 1),
            "busy_ms_per_step": round(busy, 3), "busy_fraction": round(busy / (1e3 * wall / steps), 3),
            "top": [{"name": n, "ms_per_step": round(sum(v) / 1e3 / steps, 4), "per_step": round(len(v) / steps, 1)}
                    for n, v in top]}


def streamed_prefill_ttft(engine: Engine, plan, prompts: list[list[int]], rounds: int = 2) -> dict:
    """TTFT of each prompt with the CPU stage's prompt steps streamed to the GPU (the plan's
    policy, executor/streamed_prefill.py) in the plan's streamed steps, streamed in prompt chunks
    (the engine's prefill_chunk: a crossing of the weights for each), and on the CPU's kernels,
    in turns (best of `rounds` each), beside the plan's prediction; {} where the plan streams
    nothing."""
    stage = engine.model.stages[0]
    streamed, step_tokens = stage.streamed, engine.stream_chunk
    if streamed is None:
        return {}
    out = {"stream_prefill_min_rows": plan.partition.stream_prefill_min_rows,
           "stream_prefill_step_tokens": step_tokens, "ring_bytes": fmt_bytes(streamed.device_bytes)}
    try:
        for ids in prompts:
            best = {"streamed": float("inf"), "streamed_in_chunks": float("inf"), "cpu": float("inf")}
            for _ in range(rounds):
                for how in best:
                    stage.streamed = None if how == "cpu" else streamed
                    engine.stream_chunk = engine.prefill_chunk if how == "streamed_in_chunks" else step_tokens
                    best[how] = min(best[how], _request(engine, None, ids, 1).ttft_ms)
            out[f"prompt_{len(ids)}"] = {
                "streamed_ms": round(best["streamed"], 1), "streamed_in_chunks_ms": round(best["streamed_in_chunks"], 1),
                "cpu_ms": round(best["cpu"], 1), "speedup": round(best["cpu"] / best["streamed"], 2),
                "steps_vs_chunks": round(best["streamed_in_chunks"] / best["streamed"], 2),
                "predicted_streamed_ms": round(predict_ttft_ms(plan, len(ids)), 3)}
    finally:
        stage.streamed, engine.stream_chunk = streamed, step_tokens
    return out


def _failed(e: BaseException) -> dict:
    """A run that raised, as its result: the error and where it came from (the runs after it go on)."""
    import traceback

    return {"error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exception(e)[-6:]}


@contextlib.contextmanager
def _env(name: str, value: str):
    """The environment variable `name` set to `value` for the block, as it was after."""
    was = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = was


def _ms_per_token(seq) -> float:
    return round(1e3 / seq.decode_tokens_per_s, 3) if seq.decode_tokens_per_s else float("nan")


def run_helm(model_dir: Path, plan, config: ModelConfig, ids: list[int], new_tokens: int,
             eager_too: bool = False, refit: bool = False, smoke: bool = False, profile: bool = False,
             ttft_prompts: list[list[int]] = ()) -> dict:
    """One greedy request on the plan's split: per-stage measured vs predicted; then the same
    request without a Recorder for TTFT and decode tok/s (and with it: `..._recorded`).
    eager_too: the same request again with the GPU stage's decode steps run eagerly, not as CUDA
    graphs. refit: fit δ and the η factors to this request's report (planner.calibrate), then
    measure a second request of another length against the fitted plan: the fit's error out of
    sample. smoke (no CUDA): the GPU stage's code on the CPU, its decode on the static step.
    profile (implied by eager_too): where the static decode step's time goes (decode_profile).
    ttft_prompts: TTFT of each with the CPU stage's prompt steps streamed and not (where the plan
    streams them: streamed_prefill_ttft)."""
    placement = placement_for(plan, config)
    t0 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    model = load_model(model_dir, placement, config,
                       **({"backend": "torch", "kv_slab": True, "streamed_prefill": True} if smoke else {}))
    load_s = time.perf_counter() - t0
    after_load = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    engine = Engine(model, eos_token_ids=(), prefix_cache=False)  # each request computes its whole prompt
    _request(engine, None, ids, 2)  # warm-up: the request's prompt chunks and a decode step
    recorder = Recorder(plan, "bench", config.architecture, kernel_isa(model), stream_prefill=model.stream_prefill)
    recorded = _request(engine, recorder, ids, new_tokens)
    # timed again without the recorder: its predictions run on the engine thread, once per new
    # context, so a single request pays for every one of them (reported apart)
    seq = _request(engine, None, ids, new_tokens)
    out = {"split_k": plan.partition.split_k, "load_s": round(load_s, 1), "ttft_ms": round(seq.ttft_ms, 1),
           "decode_tok_s": round(seq.decode_tokens_per_s or 0.0, 3), "decode_ms_per_token": _ms_per_token(seq),
           "decode_ms_per_token_recorded": _ms_per_token(recorded),
           "predicted_ms_per_token": plan.prediction.ms_per_token, "stages": _stage_rows(recorder)}
    if torch.cuda.is_available() and any(s.device == "cuda" for s in plan.partition.stages):
        out["gpu_memory"] = _gpu_memory(plan, model, after_load)
    if ttft_prompts:
        out["streamed_prefill"] = streamed_prefill_ttft(engine, plan, list(ttft_prompts))
    step = model.stages[-1].fused
    if isinstance(step, ResidentDecode):
        out["decode_path"] = "cuda graphs" if step.graphs else "static step, eager"
        out["graph_buckets"] = step.captured
        out["compiled"] = step.compiled
        out["paged_decode"] = step.paged
        if eager_too or profile:
            out["decode_profile"] = decode_profile(engine, ids)
        if eager_too and step.graphs:
            step.graphs = False
            out["eager_decode_ms_per_token"] = _ms_per_token(_request(engine, None, ids, new_tokens))
            out["eager_decode_profile"] = decode_profile(engine, ids)
            step.graphs = True
    else:
        out["decode_path"] = "streaming attention, op by op"
    if refit:
        try:
            searched = recalibrate(plan, recorder.report(), "bench_gpu").plan
        except PlanError as e:
            out["after_fit"] = {"error": str(e)}
        else:
            # The fitted model at the split that runs (the re-run search may move k: reported).
            here = replace(plan, partition=replace(plan.partition, forced=True))
            fitted = replan(here, searched.calibration, searched.recalibration)
            check = Recorder(fitted, "bench", config.architecture, kernel_isa(model), stream_prefill=model.stream_prefill)
            other = ids[: max(8, len(ids) // 2)]
            again = _request(engine, check, other, new_tokens)
            out["after_fit"] = {"prompt_tokens": len(other), "decode_ms_per_token": _ms_per_token(again),
                                "predicted_ms_per_token": fitted.prediction.ms_per_token,
                                "stages": _stage_rows(check), "searched_split_k": searched.partition.split_k}
    # The compiled step holds its model in a cycle (a compiled bound method): collected before
    # the cache is emptied, else the next run's peak memory counts this run's weights.
    del engine, model, step
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# Issue 11's targets: HELM's decode at the cap against Accelerate's, the all-GPU decode against the
# HBM roofline, and the GPU stage's decode steps against the plan (once δ is fitted).
TARGET_SPEEDUP, TARGET_OVER_ROOFLINE, TARGET_ERROR_PCT = 3.0, 1.25, 10.0


def targets(results: dict) -> dict:
    """Each target the runs measured: its figure, its bound and whether it was met."""
    out = {}

    def check(name, value, bound, met):
        if value is not None:
            out[name] = {"value": value, "bound": bound, "verdict": "met" if met(value) else "missed"}

    capped = results.get("capped", {})
    reserved = capped.get("helm", {}).get("gpu_memory", {}).get("peak_reserved_bytes")
    cap = results.get("gpu_memory_cap_bytes")
    if reserved is not None and cap:
        # the plan for the cap, served: CUDA's allocator never held more than the cap
        check("capped_peak_reserved_within_cap", round(reserved / cap, 3), "<= 1.0", lambda v: v <= 1.0)
    check("decode_vs_accelerate_at_cap", capped.get("decode_speedup"), f">= {TARGET_SPEEDUP}x",
          lambda v: v >= TARGET_SPEEDUP)
    for run in ("all_gpu", "all_gpu_compiled", "all_gpu_paged_decode"):
        if "invalid" not in results.get(run, {}):
            check(f"{run}_over_roofline", results.get(run, {}).get("over_roofline"), f"<= {TARGET_OVER_ROOFLINE}x",
                  lambda v: v <= TARGET_OVER_ROOFLINE)

    def gpu_decode_error(rows):
        errors = [r["error_pct"] for r in rows if r["device"] == "cuda" and r["phase"] == "decode"]
        return max(errors, key=abs) if errors else None

    within = f"|error| <= {TARGET_ERROR_PCT}%"
    helm = capped.get("helm", {})
    check("gpu_stage_predicted_first_plan", gpu_decode_error(helm.get("stages", [])), within,
          lambda v: abs(v) <= TARGET_ERROR_PCT)
    check("gpu_stage_predicted_after_fit", gpu_decode_error(helm.get("after_fit", {}).get("stages", [])), within,
          lambda v: abs(v) <= TARGET_ERROR_PCT)
    check("all_gpu_stage_predicted_first_plan", gpu_decode_error(results.get("all_gpu", {}).get("stages", [])),
          within, lambda v: abs(v) <= TARGET_ERROR_PCT)
    return out


def run_accelerate(model_dir: Path, ids: list[int], new_tokens: int, gpu_memory: int) -> dict:
    """The same request through transformers with Accelerate's device_map="auto" under the cap."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map="auto",
        max_memory={0: gpu_memory, "cpu": 512 * GIB})
    load_s = time.perf_counter() - t0
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        model.generate(x[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, do_sample=False, min_new_tokens=1)
        torch.cuda.synchronize()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    on_gpu = sum(1 for d in model.hf_device_map.values() if d not in ("cpu", "disk"))
    del model
    torch.cuda.empty_cache()
    decode_s = max(1e-9, total - ttft) / max(1, new_tokens - 1)
    # HELM's GPU stages turned cuDNN's attention off for the process (executor.attention.without_cudnn_attention),
    # so transformers' SDPA ran flash or memory-efficient attention here; its offloaded weights' copies dominate
    return {"load_s": round(load_s, 1), "ttft_ms": round(1e3 * ttft, 1), "decode_tok_s": round(1 / decode_s, 3),
            "decode_ms_per_token": round(1e3 * decode_s, 3), "modules_on_gpu": on_gpu,
            "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled()}


def hbm_roofline_ms(plan, context: int, weight_gibps: float | None = None) -> float:
    """Bytes one decode step reads on the GPU (weights + KV at `context`) over the profiled HBM
    bandwidth: the floor a batch-1 step cannot beat. With `weight_gibps`, the weights at that
    rate instead (the profile's one-token matmul: what the cost model prices them at)."""
    units = plan.ir.units[plan.partition.split_k:]
    hbm = plan.machine.gpu.hbm_gibps * GIB
    weights = sum(weight_read_bytes(u, 1) for u in units) / ((weight_gibps * GIB) if weight_gibps else hbm)
    return 1e3 * (weights + sum(u.kv_bytes_per_token * context for u in units) / hbm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="qwen3-8b", help="a tools/model_configs preset (default qwen3-8b)")
    p.add_argument("--gpu-memory", default="8GiB", help="the cap of run 1 (default 8GiB)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--split", type=int, help="run 1 at this split (units on the CPU) instead of the search's")
    p.add_argument("--long-prompt-tokens", type=int, default=1024,
                   help="run 1 also times this prompt's TTFT with the CPU stage's prompt steps streamed and not")
    p.add_argument("--context", type=int, default=1024, help="run 2's context: prompt + new tokens reach it")
    p.add_argument("--work", default="/tmp/helm-bench-gpu", help="checkpoint and profile go here (reused)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model, placeholder profile, no Accelerate")
    p.add_argument("--skip-accelerate", action="store_true")
    p.add_argument("--skip-capped", action="store_true", help="leave run 1 (the capped GPU) out")
    p.add_argument("--skip-all-gpu", action="store_true",
                   help="leave runs 2-4 (all on the GPU) out: run 1 alone, e.g. at a long prompt")
    p.add_argument("--compiled", action="store_true", help="run 3: run 2 with torch.compile (HELM_COMPILE=1)")
    p.add_argument("--paged-decode", action="store_true",
                   help="run 4: run 2 with the paged decode kernels (HELM_PAGED_DECODE=1) instead of SDPA")
    args = p.parse_args(argv)
    ready_profiler_for_graphs()  # before any capture: the runs profile their graphs' replays
    smoke = args.smoke or not torch.cuda.is_available()
    size = "tiny" if smoke else args.size
    work = Path(args.work)
    model_dir = work / f"{size}-bf16"
    if not (model_dir / "config.json").is_file():
        print(f"bench_gpu: writing a random-weight {size} checkpoint to {model_dir}", file=sys.stderr)
        make_model(None if size != "tiny" else "qwen3", size, "bf16", seed=0, out=model_dir, force=True)
    config = ModelConfig.from_dir(model_dir)
    machine_file = work / "machine.yaml"
    if smoke:
        machine = placeholder_machine()
    elif machine_file.is_file():
        machine = load_machine(machine_file)
    else:
        machine = profile_machine(quick=True, progress=stderr_progress())
        save_machine(machine, machine_file)
    cap = parse_bytes(args.gpu_memory)
    ids = prompt(args.prompt_tokens, config.vocab_size)
    # run 1's context holds the long prompt too (its TTFT is timed on the same engine)
    workload = workload_for(args.prompt_tokens, args.new_tokens,
                            context_tokens=max(args.prompt_tokens, args.long_prompt_tokens) + args.new_tokens)
    def save() -> None:   # after every run: a run cut off by a time limit keeps what finished
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")

    results: dict = {"model": size, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "gpu_memory_cap": fmt_bytes(cap), "gpu_memory_cap_bytes": cap, "prompt_tokens": args.prompt_tokens,
                     "new_tokens": args.new_tokens, "smoke": smoke}
    if machine.gpu is not None and machine.gpu.decode_block_ms is not None:
        # the profile's decode-block probe: the GPU's δ in the plans below (recalibration refits it)
        results["profile_decode_block"] = {
            "block": machine.gpu.decode_block, "ms": machine.gpu.decode_block_ms,
            "roofline_ms": machine.gpu.decode_block_roofline_ms,
            "delta_ms_per_block": machine.calibration.cuda.delta_ms_per_block}

    # 1. capped: HELM's plan against Accelerate
    if not args.skip_capped:
        try:
            capped = make_plan(model_dir, machine, workload=workload, split_k=args.split,
                               gpu_memory_bytes=min(cap, machine.gpu.vram_total_bytes))
            with _env(COMPILE_ENV, "0"):
                helm = run_helm(model_dir, capped, config, ids, args.new_tokens, refit=True, smoke=smoke,
                                ttft_prompts=[ids, prompt(args.long_prompt_tokens, config.vocab_size, seed=2)])
        except Exception as e:  # noqa: BLE001 - recorded; the runs after it go on
            helm = _failed(e)
        results["capped"] = {"helm": helm}
        save()
        if not smoke and not args.skip_accelerate:
            try:
                acc = run_accelerate(model_dir, ids, args.new_tokens, cap)
            except Exception as e:  # noqa: BLE001
                acc = _failed(e)
            results["capped"]["accelerate"] = acc
            if "error" not in acc and "error" not in helm:
                results["capped"]["decode_speedup"] = round(helm["decode_tok_s"] / acc["decode_tok_s"], 2)
                results["capped"]["ttft_speedup"] = round(acc["ttft_ms"] / helm["ttft_ms"], 2)
            save()

    # 2. all on the GPU, at the context (3. again, compiled)
    long_ids = prompt(max(1, args.context - args.new_tokens), config.vocab_size, seed=1)
    all_gpu = None if args.skip_all_gpu else make_plan(model_dir, machine, workload=workload_for(len(long_ids), args.new_tokens), split_k=0,
                        allow_infeasible=True)
    roofline = hbm_roofline_ms(all_gpu, args.context) if all_gpu and all_gpu.machine.gpu else float("nan")
    gemv = all_gpu.machine.gpu.gemv_gibps if all_gpu and all_gpu.machine.gpu else None
    runs = [] if args.skip_all_gpu else [("all_gpu", False, False)] \
        + ([("all_gpu_compiled", True, False)] if args.compiled else []) \
        + ([("all_gpu_paged_decode", False, True)] if args.paged_decode else [])
    for name, compiled, paged in runs:
        try:
            with _env(COMPILE_ENV, "1" if compiled else "0"), _env(PAGED_DECODE_ENV, "1" if paged else "0"):
                run = run_helm(model_dir, all_gpu, config, long_ids, args.new_tokens, eager_too=name == "all_gpu",
                               profile=True, smoke=smoke)
        except Exception as e:  # noqa: BLE001 - recorded; the runs after it go on
            results[name] = _failed(e)
            save()
            continue
        run["hbm_roofline_ms"] = round(roofline, 3)
        run["over_roofline"] = round(run["decode_ms_per_token"] / roofline, 2) if roofline == roofline else None
        if gemv:  # the weights at the rate the profile's one-token matmul streamed them, KV at HBM's
            run["projection_rate_ms"] = round(hbm_roofline_ms(all_gpu, args.context, gemv), 3)
        # a run that fell back from what it was to measure (the step logs why) says so, and scores nothing
        if compiled and not run.get("compiled"):
            run["invalid"] = "torch.compile did not take the decode step (see the log)"
        if paged and not run.get("paged_decode"):
            run["invalid"] = "the paged decode kernels did not take the decode step (see the log)"
        results[name] = run
        save()
    base = results.get("all_gpu", {})
    for name, key in (("all_gpu_compiled", "vs_uncompiled"), ("all_gpu_paged_decode", "vs_sdpa")):
        # compiled over not; the paged kernels over SDPA on gathered pages (all as CUDA graphs)
        run = results.get(name, {})
        if "decode_ms_per_token" in run and "decode_ms_per_token" in base and "invalid" not in run:
            run[key] = round(run["decode_ms_per_token"] / base["decode_ms_per_token"], 3)

    results["targets"] = targets(results)
    save()
    print(json.dumps(results, indent=1))
    lines = [f"target {name}: {t['verdict']} ({t['value']} vs {t['bound']})" for name, t in results["targets"].items()]
    if "profile_decode_block" in results:
        b = results["profile_decode_block"]
        lines.append(f"profile: a decode block {b['ms']} ms, roofline {b['roofline_ms']} ms: "
                     f"δ {b['delta_ms_per_block']} ms per block ({b['block']})")
    if "capped" in results:
        c = results["capped"]
        for who in ("helm", "accelerate"):
            if "error" in c.get(who, {}):
                lines.append(f"capped at {fmt_bytes(cap)}: {who} failed: {c[who]['error'][:300]}")
        if "error" not in c["helm"]:
            lines.append(f"capped at {fmt_bytes(cap)}: HELM k={c['helm']['split_k']} {c['helm']['decode_tok_s']} tok/s "
                         f"(predicted {c['helm']['predicted_ms_per_token']} ms/token, measured "
                         f"{c['helm']['decode_ms_per_token']})" + (
                             f"; Accelerate {c['accelerate']['decode_tok_s']} tok/s: {c['decode_speedup']}x"
                             if "decode_speedup" in c else ""))
        if "ttft_speedup" in c:
            lines.append(f"TTFT at {args.prompt_tokens} tokens: HELM {c['helm']['ttft_ms']} ms, Accelerate "
                         f"{c['accelerate']['ttft_ms']} ms: {c['ttft_speedup']}x")
        for key, t in c["helm"].get("streamed_prefill", {}).items():
            if key.startswith("prompt_"):
                lines.append(f"TTFT of {key.removeprefix('prompt_')} tokens, CPU stage's prompt steps streamed to the "
                             f"GPU: {t['streamed_ms']} ms (predicted {t['predicted_streamed_ms']}), on the CPU "
                             f"{t['cpu_ms']} ms: {t['speedup']}x")
    for name, _, _ in runs:
        run = results[name]
        if "error" in run:
            lines.append(f"{name} failed: {run['error'][:300]}")
            continue
        profile = run.get("decode_profile", {})
        launches = (f", {profile['kernels_per_step']} kernels a step" if "kernels_per_step" in profile
                    else f", {profile['ops_per_step']} ops a step" if "ops_per_step" in profile else "")
        label = {"all_gpu": "all-GPU", "all_gpu_compiled": "all-GPU, compiled",
                 "all_gpu_paged_decode": "all-GPU, paged decode kernels"}[name]
        lines.append(f"{label} at context {args.context}: "
                     f"{run['decode_ms_per_token']} ms/token (predicted {run['predicted_ms_per_token']}), "
                     f"HBM roofline {run['hbm_roofline_ms']} ms "
                     f"({run['over_roofline']}x){launches}" + (f" INVALID: {run['invalid']}" if "invalid" in run else ""))
    print("\n" + "\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
