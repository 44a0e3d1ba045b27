"""Making plans: trace the model, score every split on a machine, assemble the plan (DESIGN §5-6).

    make_plan("tools/model_configs/qwen3-8b.json", machine=load_machine(...))   # search
    plan_for_split("path/to/checkpoint", split_k=3)                             # no profiling
    replan(plan, calibration, recalibration)         # next version, search re-run (planner.calibrate)
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

from planner.capacity import longest_any_split, longest_context, model_max_tokens
from planner.config import config_digest, config_dtype, read_config
from planner.cost import SplitCost
from planner.errors import InfeasibleError, PlanError
from planner.machine import Calibration, MachineProfile, tool_version
from planner.plan import (DEFAULT_PAGE_SIZE_TOKENS, DEFAULT_WATERMARK, PLAN_SCHEMA_VERSION, Candidate, IRSummary,
                          KVPlan, Limits, ModelIdentity, Partition, Plan, Prediction, Search, StagePlan,
                          StagePrediction, Workload, seal)
from planner.profile import placeholder_machine
from planner.provenance import Recalibration
from planner.search import SearchSpace, best_split, evaluate_all
from planner.step_shape import step_tokens
from planner.trace import trace_model
from planner.units import fmt_bytes, round_sig

SEARCH_OBJECTIVE = ("minimum predicted time of the workload's request (TTFT + a decode step per further token) "
                    "among feasible splits (ties: larger k)")
# what plans made before the request was the objective say (their decode step alone): read as ours
EARLIER_SEARCH_OBJECTIVES = ("minimum predicted ms/token among feasible splits (ties: larger k)",)


def _r(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round_sig(x)


def prediction_of(cost: SplitCost, workload: Workload, context: int | None = None) -> Prediction:
    """The plan's `prediction` section for one scored split (rounded for a deterministic file)."""
    stages = []
    for s in cost.stages:
        ms = s.ms
        stages.append(StagePrediction(
            device=s.device, ms_per_token=_r(ms) or 0.0, roofline_ms_per_token=_r(s.roofline_ms) or 0.0,
            proj_ms_per_token=_r(s.proj_ms) or 0.0, attn_ms_per_token=_r(s.attn_ms) or 0.0,
            overhead_ms_per_token=_r(s.overhead_ms) or 0.0,
            weight_read_gibps=_r(s.read_bytes_per_step / (ms / 1e3) / (1 << 30)) if ms and math.isfinite(ms) else 0.0,
            prefill_ms=_r(s.prefill_ms) or 0.0))
    ms = cost.ms
    return Prediction(
        context_tokens=context if context is not None else workload.context_tokens,
        batch_size=workload.batch_size, stages=tuple(stages), comm_ms_per_token=_r(cost.comm_ms) or 0.0,
        roofline_ms_per_token=_r(cost.roofline_ms) or 0.0, ms_per_token=_r(ms) or 0.0,
        tokens_per_s=_r(workload.batch_size * 1e3 / ms) if ms and math.isfinite(ms) else 0.0,
        ttft_ms=_r(cost.ttft_ms) or 0.0)


def _candidate(c: SplitCost) -> Candidate:
    has_cuda = any(s.device == "cuda" for s in c.stages)
    cuda = c.stage_ms("cuda") if has_cuda else 0.0
    return Candidate(split_k=c.split_k, feasible=c.feasible, reason=c.reason,
                     cpu_ms=_r(c.stage_ms("cpu")) or 0.0, cuda_ms=_r(cuda), comm_ms=_r(c.comm_ms) or 0.0,
                     total_ms=_r(c.ms), gpu_bytes=c.gpu_bytes, host_bytes=c.host_bytes, ttft_ms=_r(c.ttft_ms))


def _budgets(machine: MachineProfile, gpu_memory: int | None, host_memory: int | None) -> tuple[int, int]:
    if gpu_memory is not None:
        if not machine.has_gpu:
            raise PlanError(f"--gpu-memory {fmt_bytes(gpu_memory)}: machine profile {machine.name!r} has no GPU")
        if gpu_memory > machine.gpu.vram_total_bytes:
            raise PlanError(f"--gpu-memory {fmt_bytes(gpu_memory)} is more than the GPU has "
                            f"({machine.gpu.name}: {fmt_bytes(machine.gpu.vram_total_bytes)} total)")
    if host_memory is not None and machine.cpu.ram_total_bytes and host_memory > machine.cpu.ram_total_bytes:
        raise PlanError(f"--host-memory {fmt_bytes(host_memory)} is more than the machine has "
                        f"({fmt_bytes(machine.cpu.ram_total_bytes)} total RAM)")
    gpu_budget = machine.gpu.vram_usable_bytes if machine.has_gpu else 0
    if gpu_memory is not None:
        gpu_budget = min(gpu_budget, gpu_memory)
    host_budget = machine.cpu.ram_available_bytes
    if host_memory is not None:
        host_budget = min(host_budget, host_memory)
    return gpu_budget, host_budget


def _infeasible(ir_units, shared, costs: tuple[SplitCost, ...], machine: MachineProfile,
                model_name: str) -> InfeasibleError:
    n = len(ir_units)
    allcpu, allgpu = costs[n], costs[0]
    reasons = [f"all-CPU (k={n}) needs {fmt_bytes(allcpu.host_bytes)} host memory, "
               f"{fmt_bytes(allcpu.host_budget_bytes)} available"]
    advice = "the machine profile has no GPU; try a shorter --context or a machine with more RAM"
    if machine.has_gpu:
        reasons.append(f"all-GPU (k=0) needs {fmt_bytes(allgpu.gpu_bytes)} VRAM, "
                       f"{fmt_bytes(allgpu.gpu_budget_bytes)} usable")
        fits = [c for c in costs if c.split_k < n and c.gpu_bytes <= c.gpu_budget_bytes]
        if fits:
            c = min(fits, key=lambda c: c.split_k)
            reasons.append(f"with the most the GPU can hold (k={c.split_k}), the host still needs "
                           f"{fmt_bytes(c.host_bytes)} > {fmt_bytes(c.host_budget_bytes)} available")
        advice = "try --kv-offload, a shorter --context, a smaller batch, or more memory"
    message = "\n".join([f"no feasible split for {model_name} on {machine.name}:", *(f"  {r}" for r in reasons),
                         f"  {advice}"])
    return InfeasibleError(message, "; ".join(reasons))


def make_plan(model: str | Path | dict, machine: MachineProfile | None = None, *,
              workload: Workload | None = None, page_size_tokens: int = DEFAULT_PAGE_SIZE_TOKENS,
              watermark: float = DEFAULT_WATERMARK, kv_offload: bool = False,
              gpu_memory_bytes: int | None = None, host_memory_bytes: int | None = None,
              split_k: int | None = None, allow_infeasible: bool = False, dtype: str | None = None,
              calibration: Calibration | None = None, parent: Plan | None = None,
              source: str | None = None, max_context: bool = False,
              latency_bound_ms: float | None = None) -> Plan:
    """Trace the model, score every split on `machine`, and return the plan for the best one
    (or for `split_k` when given). PlanError when the input is bad or nothing fits.

    With `max_context` the workload's context becomes the longest any split (or `split_k`) serves
    with its predicted decode step within `latency_bound_ms` (when given), and the plan is the
    fastest split at that context.

    With `parent` the plan is its next version and starts from the calibration
    `carry_calibration` gives it (unless `calibration` is given)."""
    data, given_source = read_config(model)
    dtype = config_dtype(data, dtype)
    machine = machine or placeholder_machine()
    workload = workload or Workload()
    _check_workload(workload)
    if page_size_tokens < 1:
        raise PlanError(f"--page-size must be at least 1 token, got {page_size_tokens}")
    if not 0 < watermark <= 1:
        raise PlanError(f"--watermark must be in (0, 1], got {watermark}")
    gpu_budget, host_budget = _budgets(machine, gpu_memory_bytes, host_memory_bytes)
    recalibration = None
    digest = config_digest(data)
    if parent is not None and parent.model.config_digest != digest:
        raise PlanError(f"--parent is a plan for another model ({parent.model.architecture}, config "
                        f"{parent.model.config_digest}): its calibration and lineage are that model's")
    if calibration is None:
        if parent is not None:
            calibration, recalibration = carry_calibration(parent, machine)
        else:
            calibration = machine.calibration

    if latency_bound_ms is not None and not (max_context and latency_bound_ms > 0):
        raise PlanError("--latency-bound goes with --max-context and must be > 0 ms/token")

    traced = trace_model(data, dtype)
    identity = ModelIdentity(architecture=traced.architecture, model_type=traced.model_type,
                             config_digest=digest, dtype=dtype, source=source or given_source,
                             num_blocks=traced.num_blocks, num_params=traced.num_params,
                             weight_bytes=traced.weight_bytes)
    ir = IRSummary(trace_context_tokens=traced.trace_context_tokens, units=traced.units,
                   shared_weights=traced.shared_weights)
    limits = Limits(gpu_memory_bytes=gpu_memory_bytes, host_memory_bytes=host_memory_bytes,
                    gpu_budget_bytes=gpu_budget, host_budget_bytes=host_budget)
    model_max = model_max_tokens(data)
    if model_max and page_size_tokens > model_max:  # no sequence holds more: the executor cuts it too
        page_size_tokens = model_max
    kv_settings = KVPlan(page_size_tokens=page_size_tokens, watermark=watermark, offload=kv_offload)
    if model_max and workload.context_tokens > model_max:
        raise PlanError(f"--context {workload.context_tokens} is longer than the model's max_position_embeddings "
                        f"({model_max}): no sequence can grow that long")
    objective = SEARCH_OBJECTIVE
    if max_context:
        workload, objective = _longest_workload(identity, ir, machine, workload, limits, kv_settings, calibration,
                                                model_max, latency_bound_ms, split_k)
    return _assemble(identity, ir, machine, workload, limits, kv_settings, split_k, allow_infeasible, calibration,
                     recalibration, parent, model_max, objective, latency_bound_ms if max_context else None)


def plan_space(plan: Plan) -> SearchSpace:
    """The search space a plan was scored in (its workload, budgets and KV settings), with the
    policy it chose for its CPU stage's prompt steps (what the executor runs)."""
    return replace(_space(plan.model.dtype, plan.workload, plan.limits, plan.kv),
                   stream_prefill=plan.partition.stream_prefill_min_rows or False,
                   stream_step_tokens=plan.partition.streamed_step_tokens,
                   priced_step_tokens=step_tokens(plan.workload.batch_size, plan.workload.context_tokens),
                   new_tokens=None)


def _space(dtype: str, workload: Workload, limits: Limits, kv: KVPlan) -> SearchSpace:
    return SearchSpace(batch=workload.batch_size, context=workload.context_tokens, prompt=workload.prompt_tokens,
                       page_size_tokens=kv.page_size_tokens, watermark=kv.watermark, offload=kv.offload,
                       gpu_budget_bytes=limits.gpu_budget_bytes, host_budget_bytes=limits.host_budget_bytes,
                       dtype=dtype, new_tokens=workload.max_new_tokens, prompt_in_steps=True)


def _longest_workload(identity: ModelIdentity, ir: IRSummary, machine: MachineProfile, workload: Workload,
                      limits: Limits, kv: KVPlan, calibration: Calibration, model_max: int,
                      bound_ms: float | None, split_k: int | None) -> tuple[Workload, str]:
    """The workload at the longest context a split serves (within the bound), and the objective."""
    n = len(ir.units)
    if split_k is not None and not 0 <= split_k <= n:
        raise PlanError(f"--split {split_k} is out of range: {identity.architecture} has {n} units (0..{n})")
    splits = range(split_k, split_k + 1) if split_k is not None else None
    tokens, k, why = longest_any_split(ir.units, ir.shared_weights, machine, _space(identity.dtype, workload, limits, kv),
                                       calibration, model_max, bound_ms, splits)
    within = f" within {bound_ms:g} ms/token" if bound_ms is not None else ""
    need = workload.prompt_tokens + workload.max_new_tokens
    if k is None:
        which = f"split k={split_k} does not serve" if split_k is not None else "no split serves"
        raise InfeasibleError(f"--max-context: {which} one KV page of {kv.page_size_tokens} tokens{within} on "
                              f"{machine.name}: {why}", f"{which} one KV page{within}: {why}")
    if tokens < need:
        raise InfeasibleError(
            f"--max-context: the longest context{within} on {machine.name} is {tokens} tokens (k={k}, then {why}), "
            f"shorter than prompt + new tokens ({workload.prompt_tokens} + {workload.max_new_tokens}): lower "
            "--prompt-tokens / --max-new-tokens", f"the longest context{within} is {tokens} tokens, shorter than "
            f"prompt + new tokens")
    objective = (f"the longest context {'split k=%d' % split_k if split_k is not None else 'any split'} serves"
                 f"{within} ({tokens} tokens at k={k}; one page more: {why}); at it, {SEARCH_OBJECTIVE}")
    return replace(workload, context_tokens=tokens), objective


def carry_calibration(parent: Plan, machine: MachineProfile) -> tuple[Calibration, Recalibration | None]:
    """The calibration a plan derived from `parent` for `machine` starts from. A parent never
    recalibrated: `machine`'s own (its profile's; the parent's came from its own machine's
    profile). The same machine: all of it. Another machine: η is relative to each machine's
    measured rates, so it carries; δ is an absolute per-block cost of the machine it was fitted
    on, so it is kept as the best prior there is — but the GPU's where `machine`'s profile timed
    a decode block (a measurement of this machine beats a fit on another), and
    `recalibration.delta_from_other_machine` says where the rest came from."""
    rec = parent.recalibration
    if rec is None:
        return machine.calibration, None
    if rec.machine == machine.name:
        return parent.calibration, replace(rec, delta_from_other_machine=False)
    calibration = parent.calibration
    if machine.gpu is not None and machine.gpu.decode_block_ms is not None:
        calibration = replace(calibration, cuda=replace(
            calibration.cuda, delta_ms_per_block=machine.calibration.cuda.delta_ms_per_block))
    return calibration, replace(rec, delta_from_other_machine=True)


# An IR traced before activations (and attention heads) were: its re-planned GPU working set
# misses them (and so does every split's feasibility); re-tracing needs the config, which a re-plan
# does without.
STALE_IR_NOTE = ("; this plan's IR predates traced activations, so the GPU stage's working set prices its "
                 "gathers, masks and pages only: plan again from the model's config to price them")


def _stale_ir(units) -> bool:
    return any(u.work_values_per_token is None or (u.kind == "block" and u.attn_heads is None) for u in units)


def replan(plan: Plan, calibration: Calibration, recalibration: Recalibration | None) -> Plan:
    """The next version of `plan` with another calibration: the search re-run from the plan's own
    IR (no config or weights needed) on the same machine, workload, limits and KV settings. A
    plan whose split was forced keeps it; otherwise the calibrated model may move k."""
    p = plan.partition
    model_max = plan.longest_context.model_max_tokens if plan.longest_context is not None else None
    # A context chosen by --max-context stays, but its latency bound held for the old calibration,
    # not necessarily for this one: the objective says where the context came from, nothing more.
    previous = plan.search.objective.replace(STALE_IR_NOTE, "")
    objective = SEARCH_OBJECTIVE if previous in (SEARCH_OBJECTIVE, *EARLIER_SEARCH_OBJECTIVES) else (
        f"{SEARCH_OBJECTIVE}, at the context plan v{plan.plan_version} chose ({plan.workload.context_tokens} tokens: "
        f"{previous.split(';')[0]}, under that plan's calibration)")
    if _stale_ir(plan.ir.units):
        objective += STALE_IR_NOTE
    return _assemble(plan.model, plan.ir, plan.machine, plan.workload, plan.limits, plan.kv,
                     p.split_k if p.forced else None, True, calibration, recalibration, plan, model_max, objective)


def _assemble(identity: ModelIdentity, ir: IRSummary, machine: MachineProfile, workload: Workload,
              limits: Limits, kv_settings: KVPlan, split_k: int | None, allow_infeasible: bool,
              calibration: Calibration, recalibration: Recalibration | None, parent: Plan | None,
              model_max: int | None, objective: str, bound_ms: float | None = None) -> Plan:
    """Score every split of `ir` on `machine` and build the plan for the best (or `split_k`);
    `model_max`: the model's position limit for the longest context (None: not stated); `bound_ms`:
    the best among splits whose decode step is within it (--max-context's --latency-bound)."""
    units, shared, n = ir.units, ir.shared_weights, len(ir.units)
    space = replace(_space(identity.dtype, workload, limits, kv_settings), latency_bound_ms=bound_ms)
    costs = evaluate_all(units, shared, machine, space, calibration)
    best = best_split(costs, workload.max_new_tokens, bound_ms)
    model_name = f"{identity.architecture} ({identity.source})"
    if split_k is not None:
        if not 0 <= split_k <= n:
            raise PlanError(f"--split {split_k} is out of range: {identity.architecture} has {n} units "
                            f"(k = units on the CPU, 0..{n})")
        chosen = costs[split_k]
        if not chosen.feasible and not allow_infeasible:
            raise InfeasibleError(f"--split {split_k} is infeasible on {machine.name}: {chosen.reason}", chosen.reason)
        if not math.isfinite(chosen.ms):  # a stage without rates (a GPU stage on a profile without one)
            raise InfeasibleError(f"--split {split_k} cannot be priced on {machine.name} ({chosen.reason}): a plan "
                                  "predicts every stage's time, --allow-infeasible or not", chosen.reason)
    elif best is None:
        raise _infeasible(units, shared, costs, machine, model_name)
    else:
        chosen = best
        if not math.isfinite(chosen.ms):  # every rate so small that no split's time is a number
            raise PlanError(f"no split of {model_name} can be priced on {machine.name}: its rates are too small "
                            "for a step's time to be a number")

    stages = tuple(StagePlan(device=s.device, unit_start=s.unit_start, unit_end=s.unit_end,
                             num_blocks=s.num_blocks, weight_bytes=s.weight_bytes,
                             working_bytes=chosen.gpu_work_bytes if s.device == "cuda" else chosen.cpu_work_bytes)
                   for s in chosen.stages)
    kv = chosen.kv
    plan = Plan(
        kind="plan", schema_version=PLAN_SCHEMA_VERSION,
        plan_version=(parent.plan_version + 1) if parent else 1, digest="",
        parent_digest=parent.digest if parent else None, tool_version=tool_version(),
        model=identity, machine=machine, workload=workload, limits=limits,
        partition=Partition(split_k=chosen.split_k, num_units=n, forced=split_k is not None, stages=stages,
                            stream_prefill_min_rows=chosen.stream_prefill_min_rows,
                            stream_prefill_step_tokens=chosen.stream_prefill_step_tokens),
        kv=replace(kv_settings, **asdict(kv)),  # the layout the search chose, on the plan's KV settings
        calibration=calibration,
        recalibration=recalibration,
        prediction=prediction_of(chosen, workload),
        # at the plan's own policy: where it streams, the ring stays in VRAM at every context
        longest_context=None if model_max is None else longest_context(
            chosen.split_k, units, shared, machine,
            # its streamed steps as large as each context leaves room for (a plan for that context's)
            replace(space, stream_prefill=chosen.stream_prefill_min_rows or False),
            calibration, model_max),
        search=Search(objective=objective,
                      best_feasible_k=best.split_k if best else None,
                      candidates=tuple(_candidate(c) for c in costs)),
        ir=ir,
    )
    return seal(plan)


def plan_for_split(model: str | Path | dict, split_k: int, machine: MachineProfile | None = None,
                   page_size_tokens: int = DEFAULT_PAGE_SIZE_TOKENS, watermark: float = DEFAULT_WATERMARK,
                   kv_offload: bool = False, workload: Workload | None = None,
                   dtype: str | None = None) -> Plan:
    """A valid plan for a given split without profiling (machine: a placeholder unless given).
    The split is scored and recorded but not required to fit (`partition.forced` is true)."""
    return make_plan(model, machine, workload=workload, page_size_tokens=page_size_tokens,
                     watermark=watermark, kv_offload=kv_offload, split_k=split_k,
                     allow_infeasible=True, dtype=dtype)


def _check_workload(w: Workload) -> None:
    if w.prompt_tokens < 1:
        raise PlanError(f"--prompt-tokens must be at least 1, got {w.prompt_tokens}")
    if w.max_new_tokens < 0:
        raise PlanError(f"--max-new-tokens must be >= 0, got {w.max_new_tokens}")
    if w.batch_size < 1:
        raise PlanError(f"--batch-size must be at least 1, got {w.batch_size}")
    if w.context_tokens < 2:
        raise PlanError(f"--context {w.context_tokens}: a sequence needs room for a prompt token and a new one (>= 2)")
    if w.context_tokens < w.prompt_tokens + w.max_new_tokens:
        raise PlanError(f"--context {w.context_tokens} is shorter than prompt + new tokens "
                        f"({w.prompt_tokens} + {w.max_new_tokens})")


def workload_for(prompt_tokens: int = 512, max_new_tokens: int = 512, batch_size: int = 1,
                 context_tokens: int | None = None) -> Workload:
    """A Workload whose context defaults to prompt + new tokens."""
    return Workload(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    context_tokens=context_tokens if context_tokens is not None else prompt_tokens + max_new_tokens)
