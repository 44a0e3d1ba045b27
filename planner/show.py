"""`helm-plan show`: a plan as a reviewer reads it — summary, stages, KV, the search table —
as JSON for tools, or as a plot of T_plan against k with the feasibility boundary."""
from __future__ import annotations

from pathlib import Path

from planner.plan import Plan
from planner.plotting import pyplot, save
from planner.serial import to_dict
from planner.units import GIB, fmt_bytes


def _stage_line(plan: Plan, i: int) -> str:
    s = plan.partition.stages[i]
    p = next(x for x in plan.prediction.stages if x.device == s.device)
    span = f"units {s.unit_start}-{s.unit_end - 1}"
    work = f" (+{fmt_bytes(s.working_bytes)} working set)" if s.working_bytes else ""
    return (f"  {s.device:<5} {span:<13} {s.num_blocks:>3} blocks {fmt_bytes(s.weight_bytes):>10}{work}  "
            f"{p.ms_per_token:>9.3f} ms/token (proj {p.proj_ms_per_token:.3f}, attn {p.attn_ms_per_token:.3f}, "
            f"δ {p.overhead_ms_per_token:.3f}), reads weights at {p.weight_read_gibps:.1f} GiB/s")


def _machine_line(plan: Plan) -> str:
    m = plan.machine
    line = (f"{m.name} ({m.source}): CPU {m.cpu.cores} cores, DRAM {m.cpu.dram_read_gibps:g} GiB/s, "
            f"L3 {fmt_bytes(m.cpu.l3_bytes)}, RAM {fmt_bytes(m.cpu.ram_available_bytes)} available")
    if m.gpu and m.link:
        line += (f"; GPU {m.gpu.name} {fmt_bytes(m.gpu.vram_usable_bytes)} usable of "
                 f"{fmt_bytes(m.gpu.vram_total_bytes)}, HBM {m.gpu.hbm_gibps:g} GiB/s"
                 + (f" (decode projections {m.gpu.gemv_gibps:g})" if m.gpu.gemv_gibps else "")
                 + (f", a decode block {1e3 * m.gpu.decode_block_ms:.0f} us (roofline "
                    f"{1e3 * m.gpu.decode_block_roofline_ms:.0f})" if m.gpu.decode_block_ms is not None else "") + "; "
                 f"link h2d {m.link.h2d_gibps:g} GiB/s, {m.link.h2d_latency_us:g} us")
    else:
        line += "; no GPU"
    return line


def _kernels_line(plan: Plan) -> str | None:
    """What the profile measured the CPU kernels to do for the plan's weight dtype (None: not
    measured; the cost model then used the DRAM and fp32 GEMM figures)."""
    k = plan.machine.cpu.kernels
    r = k.for_dtype(plan.model.dtype) if k is not None else None
    if r is None:
        return None
    block = ", ".join(f"{p.gflops:g} at {p.rows}" for p in r.prompt_gflops)
    return (f"{k.isa}, {k.threads} threads, FMA peak {k.fma_peak_gflops:g} GFLOP/s; {r.dtype}: decode GEMV "
            f"{r.gemv_gibps:g} GiB/s; prompt GEMMs on {r.gemm_path} from {r.gemm_min_rows} rows "
            f"({r.gemm_gflops:g} GFLOP/s; a block {block} rows); attention {r.attention_gflops:g} GFLOP/s, "
            f"our kernel up to {r.attention_kernel_max_queries} queries")


def format_summary(plan: Plan) -> str:
    pr, kv, w = plan.prediction, plan.kv, plan.workload
    lines = [
        f"plan      v{plan.plan_version} {plan.digest}  (schema {plan.schema_version}, helm-plan {plan.tool_version})",
        f"model     {plan.model.architecture} ({plan.model.model_type}, {plan.model.dtype}): {plan.model.num_blocks} "
        f"blocks, {plan.model.num_params / 1e9:.2f} B params, {fmt_bytes(plan.model.weight_bytes)}; "
        f"from {plan.model.source}",
        f"machine   {_machine_line(plan)}",
        *([f"kernels   {line}"] if (line := _kernels_line(plan)) else []),
        f"workload  prompt {w.prompt_tokens} + {w.max_new_tokens} new tokens, batch {w.batch_size}, "
        f"context {w.context_tokens}",
        f"split     k={plan.partition.split_k} of {plan.partition.num_units} units on the CPU"
        f"{' (forced with --split)' if plan.partition.forced else ''}",
    ]
    lines += [_stage_line(plan, i) for i in range(len(plan.partition.stages))]
    if plan.partition.stream_prefill_min_rows is not None:
        lines.append(f"  prompt steps of >= {plan.partition.stream_prefill_min_rows} tokens: the cpu stage's blocks "
                     f"on the GPU, weights streamed, up to {plan.partition.streamed_step_tokens} tokens a step")
    lines.append(f"  link  {pr.comm_ms_per_token:.4f} ms/token")
    lines.append(f"predicted {pr.ms_per_token:.3f} ms/token, {pr.tokens_per_s:.3f} tok/s at context "
                 f"{pr.context_tokens} (roofline {pr.roofline_ms_per_token:.3f} ms before δ); TTFT {pr.ttft_ms:.1f} ms")
    lc = plan.longest_context
    if lc is not None:
        lines.append(f"longest   context at batch {lc.batch_size}: {lc.without_offload_tokens} tokens (bound by "
                     f"{lc.without_offload_bound}); with KV offload {lc.with_offload_tokens} (bound by "
                     f"{lc.with_offload_bound})")
    lines.append(f"kv        pages of {kv.page_size_tokens} tokens, watermark {kv.watermark:g}, offload "
                 f"{'on' if kv.offload else 'off'}: {kv.device_pages} device page(s) of {fmt_bytes(kv.device_page_bytes)}, "
                 f"{kv.host_pages} host page(s), {kv.cpu_pages} CPU-stage page(s) of {fmt_bytes(kv.cpu_page_bytes)}")
    c = plan.calibration
    lines.append(f"calib     {c.provenance}, {c.samples} samples: δ cpu {c.cpu.delta_ms_per_block:g} ms, "
                 f"cuda {c.cuda.delta_ms_per_block:g} ms per block; η_m cpu {c.cpu.eta_memory:g}, cuda {c.cuda.eta_memory:g}; "
                 f"η_kv cpu {c.cpu.eta_kv:g}, cuda {c.cuda.eta_kv:g}; η_c cpu {c.cpu.eta_compute:g}, cuda "
                 f"{c.cuda.eta_compute:g}; η_attn cpu {c.cpu.eta_attn:g}, cuda {c.cuda.eta_attn:g}")
    r = plan.recalibration
    if r is not None:
        fits = ", ".join(f"{d.device} rms error {d.rms_error_pct_before:.1f}% -> {d.rms_error_pct_after:.1f}%"
                         for d in r.devices)
        lines.append(f"          fitted to plan v{r.measured_plan_version} {r.measured_plan_digest[:19]}… measured on "
                     f"{r.machine} at {r.measured_at} ({r.executor.source}, kernels {r.executor.kernel_isa}): {fits}")
        if r.delta_from_other_machine:
            lines.append(f"          δ came from {r.machine}, not this machine ({plan.machine.name}): recalibrate here")
    return "\n".join(lines)


def format_table(plan: Plan) -> str:
    # the prompt's TTFT, which the search weighs with decode (plans before it do not record it)
    ttft = any(c.ttft_ms is not None for c in plan.search.candidates)
    rows = [f"{'':1}{'k':>4} {'fits':>4} {'cpu_ms':>10} {'cuda_ms':>10} {'link_ms':>8} {'total_ms':>10} "
            + (f"{'ttft_ms':>10} " if ttft else "") + f"{'gpu_GiB':>8} {'host_GiB':>8}  why not"]
    for c in plan.search.candidates:
        mark = "*" if c.split_k == plan.partition.split_k else " "
        num = lambda x, w, d: f"{x:>{w}.{d}f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
        rows.append(f"{mark}{c.split_k:>4} {'yes' if c.feasible else 'no':>4} {num(c.cpu_ms, 10, 3)} "
                    f"{num(c.cuda_ms, 10, 3)} {num(c.comm_ms, 8, 4)} {num(c.total_ms, 10, 3)} "
                    + (f"{num(c.ttft_ms, 10, 1)} " if ttft else "")
                    + f"{c.gpu_bytes / GIB:>8.2f} {c.host_bytes / GIB:>8.2f}  {c.reason}")
    return "search (every k = units on the CPU; * = chosen)\n" + "\n".join(rows)


def show_json(plan: Plan) -> dict:
    pred = {s.device: s for s in plan.prediction.stages}
    return {
        "plan_version": plan.plan_version,
        "digest": plan.digest,
        "model": plan.model.architecture,
        "config_digest": plan.model.config_digest,
        "dtype": plan.model.dtype,
        "machine": plan.machine.name,
        "split_k": plan.partition.split_k,
        "num_units": plan.partition.num_units,
        "forced": plan.partition.forced,
        "predicted_ms_per_token": plan.prediction.ms_per_token,
        "roofline_ms_per_token": plan.prediction.roofline_ms_per_token,
        "tokens_per_s": plan.prediction.tokens_per_s,
        "ttft_ms": plan.prediction.ttft_ms,
        "context_tokens": plan.prediction.context_tokens,
        "stages": [{"device": s.device, "unit_start": s.unit_start, "unit_end": s.unit_end,
                    "num_blocks": s.num_blocks, "weight_bytes": s.weight_bytes,
                    "ms_per_token": pred[s.device].ms_per_token} for s in plan.partition.stages],
        "comm_ms_per_token": plan.prediction.comm_ms_per_token,
        "kv": {"page_size_tokens": plan.kv.page_size_tokens, "watermark": plan.kv.watermark,
               "offload": plan.kv.offload, "device_pages": plan.kv.device_pages, "host_pages": plan.kv.host_pages},
        "best_feasible_k": plan.search.best_feasible_k,
        "machine_source": plan.machine.source,
        "longest_context": to_dict(plan.longest_context),
    }


def plot_plan(plan: Plan, out: str | Path) -> None:
    """T_plan against k, feasible candidates filled, infeasible hollow, boundary shaded."""
    plt = pyplot("the summary above is complete")
    cands = [c for c in plan.search.candidates if c.total_ms is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    fk = [c.split_k for c in cands if c.feasible]
    ax.plot([c.split_k for c in cands], [c.total_ms for c in cands], color="0.7", lw=1, zorder=1)
    ax.scatter(fk, [c.total_ms for c in cands if c.feasible], color="tab:blue", label="feasible", zorder=2)
    ax.scatter([c.split_k for c in cands if not c.feasible], [c.total_ms for c in cands if not c.feasible],
               facecolors="none", edgecolors="tab:red", label="infeasible", zorder=2)
    if fk:
        ax.axvspan(min(fk) - 0.5, max(fk) + 0.5, color="tab:blue", alpha=0.07, label="feasible region")
    chosen = next(c for c in plan.search.candidates if c.split_k == plan.partition.split_k)
    if chosen.total_ms is not None:
        ax.scatter([chosen.split_k], [chosen.total_ms], marker="*", s=220, color="gold", edgecolors="k",
                   zorder=3, label=f"chosen k={chosen.split_k}")
    ax.set_xlabel("k = units on the CPU")
    ax.set_ylabel("predicted ms / token")
    ax.set_title(f"{plan.model.architecture} on {plan.machine.name} (context {plan.prediction.context_tokens})")
    ax.legend(loc="best")
    save(fig, out)
