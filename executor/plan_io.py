"""Load a helm-plan plan for execution: validate it, check it belongs to these weights, and turn
its partition and KV settings into a `Placement`.

The plan type itself lives in `planner.plan` (one type, two users); this module only reads it.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from executor.errors import PlacementError
from executor.model_config import ModelConfig
from executor.placement import KernelChoice, Placement, StageSpec, resolve_device
from planner.config import config_digest
from planner.errors import PlanError
from planner.plan import Plan, load_plan, parse_plan
from planner.profile import meminfo
from planner.step_shape import running_sequences
from planner.units import fmt_bytes

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def load_checked_plan(plan_path_or_text, model_dir: str | Path, config: ModelConfig, text: str | None = None) -> Plan:
    """The plan, schema-validated and checked against the checkpoint's config.json and dtype.
    With `text`, the plan is that YAML text and nothing is read from disk (whatever it says)."""
    try:
        plan = parse_plan(text, plan_path_or_text) if text is not None else load_plan(plan_path_or_text)
    except PlanError as e:
        raise PlacementError(f"invalid plan: {e}") from None
    except OSError as e:
        raise PlacementError(f"cannot read plan {plan_path_or_text}: {e}") from None
    return check_plan_fits(plan, model_dir, config)


def check_plan_fits(plan: Plan, model_dir: str | Path, config: ModelConfig) -> Plan:
    """`plan` (already parsed and validated), checked against the checkpoint's config and dtype."""
    digest = config_digest(Path(model_dir) / "config.json")
    if plan.model.config_digest != digest:
        raise PlacementError(  # strings from the plan are cut short: it may come from the network
            f"the plan was made for another model ({plan.model.architecture[:80]}, config "
            f"{plan.model.config_digest[:19]}…, from {plan.model.source[:200]}); the checkpoint in {model_dir} has "
            f"config {digest[:19]}…: make a plan for it with `helm-plan plan {model_dir}`"
        )
    weights_dtype = _DTYPE_NAMES[str(config.dtype)]
    if plan.model.dtype != weights_dtype:
        raise PlacementError(f"the plan assumes {plan.model.dtype} weights; the checkpoint holds {weights_dtype}: "
                             f"plan again with `--dtype {weights_dtype}`")
    return plan


def placement_from_plan(plan_path_or_text, model_dir: str | Path, config: ModelConfig,
                        page_size_tokens: int | None = None, device_kv_pages: int | None = None,
                        cpu_threads: int | None = None) -> Placement:
    """`placement_for` the plan at a path (or in YAML text), checked against the checkpoint."""
    plan = load_checked_plan(plan_path_or_text, model_dir, config)
    return placement_for(plan, config, page_size_tokens, device_kv_pages, cpu_threads)


def placement_for(plan, config: ModelConfig, page_size_tokens: int | None = None,
                  device_kv_pages: int | None = None, cpu_threads: int | None = None) -> Placement:
    """The stages and KV settings of a checked plan; CPU threads: `cpu_threads` if given, else the
    cores the plan's machine profile measured with (its bandwidth figures assume that many)."""
    kv = plan.kv
    placement = Placement(
        stages=tuple(StageSpec(s.device, s.unit_start, s.unit_end) for s in plan.partition.stages),
        num_units=plan.partition.num_units,
        page_size_tokens=page_size_tokens or kv.page_size_tokens,
        device_kv_pages=device_kv_pages,
        kv_sequences=plan.workload.batch_size,
        context_tokens=plan.workload.context_tokens,
        max_running=running_sequences(plan.workload.batch_size * -(-plan.workload.context_tokens // kv.page_size_tokens)),
        flash_attention=plan.machine.gpu.flash_attention if plan.machine.gpu is not None else None,
        kernel_choice=kernel_choice_of(plan),
        stream_prefill_min_rows=plan.partition.stream_prefill_min_rows,
        stream_prefill_step_tokens=plan.partition.streamed_step_tokens,
    )
    placement.validate()
    placement = fit_page_size(placement, config)
    if device_kv_pages is None and kv.offload and kv.device_pages:
        # Offload on: the GPU stage holds in VRAM the tokens the plan's device pages hold, in this
        # placement's pages (a --page-size override or a page cut to the context), the rest on the host.
        planned_tokens = kv.device_pages * kv.page_size_tokens
        placement = replace(placement, device_kv_pages=max(1, planned_tokens // placement.page_size_tokens))
        held = placement.device_kv_pages * placement.page_size_tokens
        if held != planned_tokens:
            # fewer: a prompt chunk of a sequence longer than the pool streams its pages where the plan
            # priced a gather (executor/kv_cache.py gathers); more (a page of one): that page's VRAM
            log.warning("KV pages of %d tokens: the GPU stage's device pool holds %d tokens where the plan "
                        "priced %d (%d pages of %d)", placement.page_size_tokens, held, planned_tokens,
                        kv.device_pages, kv.page_size_tokens)
    return placement.with_threads(cpu_threads or plan.machine.cpu.cores)


def fit_page_size(placement: Placement, config: ModelConfig) -> Placement:
    """The placement with its KV page at most the model's context: no sequence holds more tokens,
    so a longer page (16M tokens, 32 GiB) only reserves memory that can never be used."""
    if placement.page_size_tokens <= config.max_position_embeddings:
        return placement
    log.info("KV page of %d tokens is longer than the model's context: using %d", placement.page_size_tokens,
             config.max_position_embeddings)
    return replace(placement, page_size_tokens=config.max_position_embeddings)


def host_memory_available() -> int | None:
    """MemAvailable in bytes; None where it cannot be read."""
    return meminfo()[1] or None


def plan_gpu_bytes(plan: Plan) -> int:
    """What the plan priced for the GPU at its split (weights, device KV pages, working set)."""
    return next((c.gpu_bytes for c in plan.search.candidates if c.split_k == plan.partition.split_k), 0)


def check_gpu_memory_fits(plan: Plan, cap_bytes: int | None, loaded: tuple[Plan, ...] = ()) -> None:
    """A plan whose GPU stage is priced at more than `cap_bytes` (the daemon's --gpu-memory) is
    refused before anything loads: under the cap its allocations would fail mid-load or
    mid-request. Beside the plans `loaded` (the one serving, and earlier ones still finishing
    their requests: a swap holds them all until they end) all of them together."""
    if cap_bytes is None:
        return
    need = plan_gpu_bytes(plan)
    if need > cap_bytes:
        raise PlacementError(f"the plan's GPU stage needs {fmt_bytes(need)} of GPU memory (weights, KV pages, working "
                             f"set), over this daemon's --gpu-memory of {fmt_bytes(cap_bytes)}: plan again with "
                             f"`helm-plan plan --gpu-memory {cap_bytes}`")
    held = sum(plan_gpu_bytes(p) for p in loaded)
    if need + held > cap_bytes:
        raise PlacementError(f"the plan's GPU stage needs {fmt_bytes(need)} of GPU memory beside the {fmt_bytes(held)} "
                             f"of the {len(loaded)} plan(s) loaded (the one serving, and any finishing their requests), "
                             f"over this daemon's --gpu-memory of {fmt_bytes(cap_bytes)}: a swap holds them until they "
                             f"end; retry once they have, or restart the daemon with the new plan")


def check_host_kv_fits(placement: Placement, config: ModelConfig, sequences: int,
                       available: int | None = None) -> None:
    """The KV pages the engine may hold must fit the host memory available now, for the stages
    whose pages live on the host (the CPU stages, and all stages without CUDA): the plan's budget
    of pages, or without one, a first page for each of `sequences`. PlacementError naming the
    sizes otherwise."""
    available = host_memory_available() if available is None else available
    if available is None:
        return
    budget = placement.kv_budget_pages
    pages = budget if budget is not None else sequences
    what = (f"the plan's KV budget of {pages} pages (its batch x context)" if budget is not None
            else f"{sequences} sequences' first pages")
    token_bytes = 2 * config.num_kv_heads * config.head_dim * torch.empty((), dtype=config.dtype).element_size()

    def layers(on: str) -> int:
        return sum(len(range(max(s.unit_start, 1), min(s.unit_end, config.num_layers + 1)))
                   for s in placement.stages if resolve_device(s.device).type == on)

    # Stages on the host hold every page there; a CUDA stage with KV offload parks the pages beyond
    # its device pages in pinned host memory (loader.kv_pools).
    parked = 0
    if budget is not None and placement.device_kv_pages is not None:
        parked = max(0, budget - placement.device_kv_pages) * layers("cuda")
    need = (pages * layers("cpu") + parked) * placement.page_size_tokens * token_bytes
    if need > available:
        raise PlacementError(
            f"KV pages of {placement.page_size_tokens} tokens: {what} need {need / 2**30:.2f} GiB of host "
            f"memory for the host-side stages, and {available / 2**30:.2f} GiB is available: plan with a "
            "smaller --page-size or --context, or for a smaller batch")


def kernel_choice_of(plan) -> KernelChoice | None:
    """What the plan's machine profile measured the CPU kernels to take for the plan's weight
    dtype; None when it did not measure them for it."""
    kernels = plan.machine.cpu.kernels
    rates = kernels.for_dtype(plan.model.dtype) if kernels is not None else None
    if rates is None:
        return None
    return KernelChoice(isa=kernels.isa, threads=kernels.threads,
                        gemm_routes=((rates.dtype, rates.gemm_path, rates.gemm_min_rows),),
                        attention_max_queries=rates.attention_kernel_max_queries)
