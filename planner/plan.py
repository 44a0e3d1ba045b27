"""The plan: the one type the planner writes and the executor loads (DESIGN §6).

A plan is a tree of frozen dataclasses, written as deterministic YAML (field order = key order,
floats rounded to 6 significant digits) with a three-line comment header for a reviewer, and
validated against schemas/plan.schema.json on load by both users. `digest` is the sha256 of the
canonical JSON of everything else, so a hand-edited plan is detected.

    plan = load_plan("plans/qwen3-8b.laptop-rtx4060.yaml")
    plan.partition.split_k, plan.partition.stages[0].device, plan.kv.device_pages
    save_plan(plan, path); plan.to_yaml()
    make_plan("tools/model_configs/qwen3-8b.json", machine=load_machine(...))   # search
    plan_for_split("path/to/checkpoint", split_k=3)                             # no profiling
    replan(plan, calibration, recalibration)         # next version, search re-run (planner.calibrate)
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from planner.capacity import LongestContext, longest_any_split, longest_context, model_max_tokens
from planner.config import config_digest, config_dtype, read_config
from planner.cost import PREFILL_CHUNK_TOKENS, SplitCost, evaluate_split
from planner.errors import PlanError
from planner.machine import Calibration, MachineProfile, check_machine, placeholder_machine, tool_version
from planner.search import SearchSpace, best_split, evaluate_all
from planner.serial import OMIT_IF_NONE, from_dict, to_dict
from planner.trace import SharedWeight, UnitIR, trace_model
from planner.units import fmt_bytes, round_sig

__all__ = [
    "PlanError", "Plan", "ModelIdentity", "IRSummary", "Workload", "Limits", "StagePlan", "Partition",
    "KVPlan", "StagePrediction", "Prediction", "Candidate", "Search", "UnitIR", "SharedWeight",
    "Recalibration", "MeasurementSource", "DeviceFit", "PrefillFit", "FitResidual",
    "load_plan", "save_plan", "make_plan", "plan_for_split", "replan", "config_digest", "plan_digest", "predict",
    "predict_ttft_ms",
    "PLAN_SCHEMA_VERSION",
]

PLAN_SCHEMA_VERSION = 1
SEARCH_OBJECTIVE = "minimum predicted ms/token among feasible splits (ties: larger k)"
DEFAULT_PAGE_SIZE_TOKENS = 512
DEFAULT_WATERMARK = 0.8


@dataclass(frozen=True)
class ModelIdentity:
    architecture: str           # Hugging Face class, e.g. "Qwen3ForCausalLM"
    model_type: str             # e.g. "qwen3"
    config_digest: str          # planner.config.config_digest of the config
    dtype: str                  # weight dtype: bfloat16 | float16 | float32
    source: str                 # the config path the plan was made from, as given
    num_blocks: int             # L
    num_params: int
    weight_bytes: int           # every unique parameter


@dataclass(frozen=True)
class IRSummary:
    """Per-unit costs from the trace; enough to re-evaluate the cost model without re-tracing."""
    trace_context_tokens: int
    units: tuple[UnitIR, ...]           # unit 0 = embedding, 1..L = blocks, L+1 = final norm + head
    shared_weights: tuple[SharedWeight, ...]


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 512
    max_new_tokens: int = 512
    batch_size: int = 1
    context_tokens: int = 1024          # KV capacity per sequence; decode is costed at this context


@dataclass(frozen=True)
class Limits:
    gpu_memory_bytes: int | None        # --gpu-memory cap as given (None: no cap)
    host_memory_bytes: int | None       # --host-memory cap as given (None: no cap)
    gpu_budget_bytes: int               # usable VRAM after the cap (0 without a GPU)
    host_budget_bytes: int              # available host RAM after the cap


@dataclass(frozen=True)
class StagePlan:
    device: str                         # "cpu" | "cuda"
    unit_start: int
    unit_end: int                       # exclusive
    num_blocks: int
    weight_bytes: int                   # resident weights (a tied weight counted once per device)


@dataclass(frozen=True)
class Partition:
    split_k: int                        # units on the CPU: [0, split_k) cpu, [split_k, num_units) cuda
    num_units: int                      # num_blocks + 2
    forced: bool                        # chosen with --split rather than by the search
    stages: tuple[StagePlan, ...]       # the non-empty stages, cpu first


@dataclass(frozen=True)
class KVPlan:
    page_size_tokens: int = DEFAULT_PAGE_SIZE_TOKENS
    watermark: float = DEFAULT_WATERMARK  # fraction of the VRAM left after weights before pages move out
    offload: bool = False               # GPU-stage pages may move to pinned host memory
    pages_per_sequence: int = 0         # ceil(context_tokens / page_size_tokens)
    device_page_bytes: int = 0          # one page over every GPU-stage block
    cpu_page_bytes: int = 0             # one page over every CPU-stage block
    device_pages: int = 0               # GPU-stage pages held in VRAM
    host_pages: int = 0                 # GPU-stage pages parked in pinned host memory
    cpu_pages: int = 0                  # CPU-stage pages in host RAM


@dataclass(frozen=True)
class StagePrediction:
    device: str
    ms_per_token: float                 # roofline + overhead
    roofline_ms_per_token: float        # proj + attn
    proj_ms_per_token: float
    attn_ms_per_token: float
    overhead_ms_per_token: float        # num_blocks · δ
    weight_read_gibps: float            # weight bytes read per step / ms_per_token: what it implies
    prefill_ms: float


@dataclass(frozen=True)
class Prediction:
    context_tokens: int
    batch_size: int
    stages: tuple[StagePrediction, ...]
    comm_ms_per_token: float            # T_comm: latency + one hidden state over the link
    roofline_ms_per_token: float        # before δ
    ms_per_token: float
    tokens_per_s: float                 # batch_size · 1000 / ms_per_token
    ttft_ms: float                      # prefill of prompt_tokens


@dataclass(frozen=True)
class Candidate:
    split_k: int
    feasible: bool
    reason: str                         # why not ("" when feasible)
    cpu_ms: float                       # per token (0 when no CPU stage)
    cuda_ms: float | None               # per token (None when the machine has no GPU)
    comm_ms: float
    total_ms: float | None
    gpu_bytes: int                      # weights + device KV
    host_bytes: int                     # CPU weights + CPU KV + offloaded pages


@dataclass(frozen=True)
class Search:
    objective: str
    best_feasible_k: int | None         # the search's answer (None: nothing feasible)
    candidates: tuple[Candidate, ...]   # every k in 0..num_units


@dataclass(frozen=True)
class MeasurementSource:
    """Which executor measured the steps a calibration was fitted to."""
    source: str                         # "daemon HOST:PORT" | "report PATH" (as given to recalibrate)
    architecture: str                   # model the daemon ran
    kernel_isa: str                     # CPU kernels during the measurements ("helm-avx512", "torch", ...)
    steps: int                          # engine steps the daemon measured on the plan


@dataclass(frozen=True)
class PrefillFit:
    """What the fit found for one device's prefill rows (prompt chunks), with δ from its decode rows."""
    eta_compute: float                  # η_c after the fit: achieved / profiled FLOP rate of the projections
    eta_compute_stderr: float | None
    eta_attn: float                     # η_attn after the fit (fitted, or kept from the measured plan)
    eta_attn_fitted: bool               # false: fewer than 3 buckets, or they do not pin it (see note)
    eta_attn_stderr: float | None
    note: str
    buckets: int                        # prefill rows (context buckets) in the fit
    samples: int                        # prefill steps in them
    rms_error_pct_before: float
    rms_error_pct_after: float
    max_abs_error_pct_before: float
    max_abs_error_pct_after: float


@dataclass(frozen=True)
class DeviceFit:
    """What the fit found for one device (its decode rows)."""
    device: str
    delta_ms_per_block: float           # fitted δ (>= 0)
    delta_stderr_ms: float | None       # its standard error (None: no degrees of freedom left)
    eta_kv: float                       # η_kv after the fit (fitted, or kept from the measured plan)
    eta_kv_fitted: bool                 # false: fewer than 3 context buckets (or kept; see note)
    eta_kv_stderr: float | None
    eta_memory: float                   # η_m after the fit (fitted only where δ would be < 0, else kept)
    eta_memory_fitted: bool             # true: the model over-predicted without overhead: δ held at 0, η_m fitted
    eta_memory_stderr: float | None
    note: str                           # why η_kv was kept, δ held at 0, what the residuals say ("" if nothing)
    buckets: int                        # decode rows (context buckets) in the fit
    samples: int                        # decode steps in those rows
    rms_error_pct_before: float         # over the fitted rows, the measured plan's model
    rms_error_pct_after: float          # the same rows, the calibrated model
    max_abs_error_pct_before: float
    max_abs_error_pct_after: float
    prefill: PrefillFit | None          # None: too few prefill steps to fit η_c (kept; see note)


@dataclass(frozen=True)
class FitResidual:
    """One fitted report row: measured against the model before and after calibration."""
    stage: int
    device: str
    phase: str                          # "decode" | "prefill"
    context_min: int                    # bucket [context_min, context_max) in tokens
    context_max: int
    samples: int                        # steps in the row
    context_mean: float
    batch_mean: float
    measured_ms: float                  # mean measured stage time per step
    predicted_before_ms: float          # the measured plan's prediction (from the report)
    predicted_after_ms: float           # the calibrated model on the same steps
    error_before_pct: float             # (measured - predicted) / predicted * 100
    error_after_pct: float
    weight: float                       # robust weight in the final fit (1: full; < 1: an outlier, down-weighted)


@dataclass(frozen=True)
class Recalibration:
    """Where `calibration` came from: the measurements, the fit and its residuals (DESIGN §8).
    Absent from plans whose calibration is the default or entered by hand."""
    method: str                         # the fit, in words
    measured_at: str                    # when the daemon made the report (UTC): the calibration's date
    machine: str                        # machine profile the measured plan was made for
    delta_from_other_machine: bool      # true: δ was fitted on `machine`, not on this plan's machine
    measured_plan_version: int          # the plan whose steps were measured
    measured_plan_digest: str
    measured_split_k: int
    executor: MeasurementSource
    devices: tuple[DeviceFit, ...]      # one per device of the measured plan
    residuals: tuple[FitResidual, ...]  # every fitted row


@dataclass(frozen=True)
class Plan:
    kind: str                           # always "plan"
    schema_version: int
    plan_version: int                   # 1, then +1 per recalibration
    digest: str                         # sha256 of the canonical plan without this field
    parent_digest: str | None           # digest of the plan this one was derived from
    tool_version: str
    model: ModelIdentity
    machine: MachineProfile             # embedded: a plan is self-contained
    workload: Workload
    limits: Limits
    partition: Partition
    kv: KVPlan
    calibration: Calibration            # δ, η used for the prediction
    # Where the calibration came from (set by `helm-plan recalibrate`, carried by --parent); not
    # written when None, so plans with a default calibration read as before.
    recalibration: Recalibration | None = field(default=None, kw_only=True)
    prediction: Prediction
    # Stated by every plan made since it was added; absent from older files, which load as before.
    longest_context: LongestContext | None = field(default=None, metadata=OMIT_IF_NONE, kw_only=True)
    search: Search
    ir: IRSummary

    def to_dict(self) -> dict:
        data = to_dict(self)
        if data["recalibration"] is None:
            del data["recalibration"]
        return data

    def to_yaml(self) -> str:
        from planner.yamlio import dump_yaml
        return dump_yaml(self.to_dict(), header_lines(self))

    def stage(self, device: str) -> StagePlan | None:
        return next((s for s in self.partition.stages if s.device == device), None)


# ---- digest, load, save ----------------------------------------------------------------------

def _canonical(data: dict) -> bytes:
    body = {k: v for k, v in data.items() if k != "digest"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def plan_digest(plan_or_dict: Plan | dict) -> str:
    data = plan_or_dict if isinstance(plan_or_dict, dict) else plan_or_dict.to_dict()
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


def _seal(plan: Plan) -> Plan:
    return replace(plan, digest=plan_digest(plan))


def plan_from_dict(data: dict, what: str = "plan", verify_digest: bool = True) -> Plan:
    from planner.schema import validate

    if not isinstance(data, dict):
        raise PlanError(f"{what}: expected a YAML mapping at the top, got {type(data).__name__}")
    validate(data, "plan", what)
    plan = from_dict(Plan, data)
    if verify_digest:
        actual = plan_digest(data)
        if actual != plan.digest:
            raise PlanError(f"{what}: digest mismatch at field 'digest': the file says {plan.digest}, its "
                            f"content hashes to {actual}; the plan was edited after helm-plan wrote it "
                            "(make a new plan instead)")
    _check_consistency(plan, what)
    return plan


def parse_plan(text: str, label: str = "plan") -> Plan:
    """A plan from its YAML text (never read as a path, whatever the text is)."""
    from planner.yamlio import parse_yaml

    return plan_from_dict(parse_yaml(text, label), label)


def load_plan(path_or_text: str | Path, verify_digest: bool = True) -> Plan:
    """Read, schema-validate and digest-check a plan (a path or YAML text). PlanError when bad."""
    from planner.yamlio import read_yaml

    data, what = read_yaml(path_or_text, "plan")
    return plan_from_dict(data, what, verify_digest)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan's YAML (validated first, so a bad plan never reaches disk)."""
    from planner.schema import validate
    validate(plan.to_dict(), "plan", "plan")
    Path(path).write_text(plan.to_yaml())


def _check_consistency(plan: Plan, what: str) -> None:
    """Cross-field rules a JSON Schema cannot say."""
    p, n = plan.partition, len(plan.ir.units)

    def bad(field: str, msg: str):
        raise PlanError(f"{what}: inconsistent plan at field '{field}': {msg}")

    check_machine(plan.machine, what, "machine.")
    if p.num_units != n or n != plan.model.num_blocks + 2:
        bad("partition.num_units", f"{p.num_units} units, ir has {n}, model has {plan.model.num_blocks} blocks")
    if not 0 <= p.split_k <= n:
        bad("partition.split_k", f"{p.split_k} is outside 0..{n}")
    expected = [("cpu", 0, p.split_k), ("cuda", p.split_k, n)]
    expected = [e for e in expected if e[1] < e[2]]
    got = [(s.device, s.unit_start, s.unit_end) for s in p.stages]
    if got != expected:
        bad("partition.stages", f"stages {got} do not match split_k={p.split_k} of {n} units (want {expected})")
    for i, u in enumerate(plan.ir.units):
        if u.index != i:
            bad(f"ir.units[{i}].index", f"is {u.index}")
    if len(plan.search.candidates) != n + 1:
        bad("search.candidates", f"{len(plan.search.candidates)} rows, want one per k in 0..{n}")


# ---- making plans ----------------------------------------------------------------------------

def model_label(source: str, model_type: str) -> str:
    """A short name for the model a plan was made from: a config file by its stem (qwen3-8b.json),
    a checkpoint directory by its whole name (models/qwen3-0.6b: its "suffix" is not an extension)."""
    if source in ("", "<dict>"):
        return model_type
    path = Path(source)
    name = path.stem if path.suffix == ".json" else path.name
    return (path.parent.name or name) if name == "config" else name


def header_lines(plan: Plan) -> list[str]:
    """The comment header: the decision in three lines."""
    p, pr = plan.partition, plan.prediction

    def describe(s: StagePlan) -> str:
        parts = []
        if s.unit_start == 0:
            parts.append("embedding")
        if s.num_blocks:
            parts.append(f"{s.num_blocks} block{'s' if s.num_blocks != 1 else ''}")
        if s.unit_end == p.num_units:
            parts.append("head")
        return f"{s.device} units {s.unit_start}-{s.unit_end - 1} ({' + '.join(parts)}, {fmt_bytes(s.weight_bytes)})"

    name = model_label(plan.model.source, plan.model.model_type)
    profile = "" if plan.machine.source == "measured" else f" ({plan.machine.source} profile)"
    line1 = (f"HELM plan v{plan.plan_version}: {plan.model.architecture} ({name}, {plan.model.dtype}) on "
             f"{plan.machine.name}{profile}: split k={p.split_k} of {p.num_units} units"
             f"{' (forced)' if p.forced else ''}: " + "; ".join(describe(s) for s in p.stages))
    terms = [f"{s.device} {s.ms_per_token:g}" for s in pr.stages]
    if len(pr.stages) > 1:
        terms.append(f"link {pr.comm_ms_per_token:g}")
    line2 = (f"Predicted {pr.ms_per_token:g} ms/token ({pr.tokens_per_s:g} tok/s) at context "
             f"{pr.context_tokens}, batch {pr.batch_size}: {' + '.join(terms)} ms"
             f" (roofline {pr.roofline_ms_per_token:g} ms before δ); TTFT {pr.ttft_ms:g} ms")
    lines = [line1, line2, "Why: " + _why(plan)]
    if plan.longest_context is not None:
        lines.append(_longest_line(plan.longest_context))
    if plan.recalibration is not None:
        lines.append(_calibration_line(plan))
    return lines


def _longest_line(c: LongestContext) -> str:
    line = (f"Longest context at batch {c.batch_size}: {c.without_offload_tokens} tokens "
            f"(bound by {c.without_offload_bound})")
    if (c.with_offload_tokens, c.with_offload_bound) != (c.without_offload_tokens, c.without_offload_bound):
        line += f"; with KV offload {c.with_offload_tokens} tokens (bound by {c.with_offload_bound})"
    return line + "."


def _calibration_line(plan: Plan) -> str:
    rec, cal = plan.recalibration, plan.calibration
    fits = "; ".join(
        f"{d.device} δ {cal.for_device(d.device).delta_ms_per_block:g} ms/block, η_kv "
        f"{cal.for_device(d.device).eta_kv:g}{'' if d.eta_kv_fitted else ' (kept)'}"
        f"{f', η_m {d.eta_memory:g}' if d.eta_memory_fitted else ''}"
        f"{f', prefill η_c {d.prefill.eta_compute:g}, η_attn {d.prefill.eta_attn:g}' if d.prefill else ''}"
        for d in rec.devices)
    where = (f"from {max(d.samples for d in rec.devices)} decode steps of plan v{rec.measured_plan_version} "
             f"measured on {rec.machine} at {rec.measured_at}")
    if rec.delta_from_other_machine:
        return (f"Calibration carried from {rec.machine}: η as fitted there; δ was measured on {rec.machine}, "
                f"not on {plan.machine.name}: recalibrate on this machine ({fits}).")
    errors = ", ".join(f"{d.device} {d.rms_error_pct_before:.1f}% -> {d.rms_error_pct_after:.1f}%" for d in rec.devices)
    return f"Calibrated {where}: {fits}; rms decode error {errors}."


def _why(plan: Plan) -> str:
    cands = {c.split_k: c for c in plan.search.candidates}
    k, n = plan.partition.split_k, plan.partition.num_units
    notes = []
    if plan.partition.forced:
        best = plan.search.best_feasible_k
        if best is not None and best != k:
            notes.append(f"forced by --split; the search would pick k={best} "
                         f"({cands[best].total_ms:g} ms/token)")
        else:
            notes.append("forced by --split")
    elif k > 0:
        c = cands[k - 1]
        if not c.feasible:
            notes.append(f"k={k - 1} (one more unit on the GPU) is infeasible: {c.reason}")
        elif c.total_ms is not None:
            notes.append(f"k={k - 1} is slower ({c.total_ms:g} ms/token)")
    else:
        notes.append("everything fits on the GPU")
    allcpu = cands[n]
    if k != n and allcpu.total_ms is not None:
        notes.append(f"all-CPU would take {allcpu.total_ms:g} ms/token"
                     f"{'' if allcpu.feasible else ' (and is infeasible)'}")
    return "; ".join(notes) + "."


def _r(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round_sig(x)


def _prediction(cost: SplitCost, workload: Workload, context: int | None = None) -> Prediction:
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
                     total_ms=_r(c.ms), gpu_bytes=c.gpu_bytes, host_bytes=c.host_bytes)


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


def _infeasible_message(ir_units, shared, costs: tuple[SplitCost, ...], machine: MachineProfile,
                        model_name: str) -> str:
    n = len(ir_units)
    allcpu, allgpu = costs[n], costs[0]
    lines = [f"no feasible split for {model_name} on {machine.name}:"]
    lines.append(f"  all-CPU (k={n}) needs {fmt_bytes(allcpu.host_bytes)} host memory, "
                 f"{fmt_bytes(allcpu.host_budget_bytes)} available")
    if machine.has_gpu:
        lines.append(f"  all-GPU (k=0) needs {fmt_bytes(allgpu.gpu_bytes)} VRAM, "
                     f"{fmt_bytes(allgpu.gpu_budget_bytes)} usable")
        fits = [c for c in costs if c.split_k < n and c.gpu_bytes <= c.gpu_budget_bytes]
        if fits:
            c = min(fits, key=lambda c: c.split_k)
            lines.append(f"  with the most the GPU can hold (k={c.split_k}), the host still needs "
                         f"{fmt_bytes(c.host_bytes)} > {fmt_bytes(c.host_budget_bytes)} available")
        lines.append("  try --kv-offload, a shorter --context, a smaller batch, or more memory")
    else:
        lines.append("  the machine profile has no GPU; try a shorter --context or a machine with more RAM")
    return "\n".join(lines)


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

    With `parent` the plan is its next version and inherits its calibration (unless
    `calibration` is given) by `carry_calibration`: a parent calibrated on another machine keeps
    its η and δ, but the plan says that δ was measured elsewhere."""
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
    if calibration is None:
        if parent is not None:
            calibration, recalibration = carry_calibration(parent, machine)
        else:
            calibration = machine.calibration

    if latency_bound_ms is not None and not (max_context and latency_bound_ms > 0):
        raise PlanError("--latency-bound goes with --max-context and must be > 0 ms/token")

    traced = trace_model(data, dtype)
    identity = ModelIdentity(architecture=traced.architecture, model_type=traced.model_type,
                             config_digest=config_digest(data), dtype=dtype, source=source or given_source,
                             num_blocks=traced.num_blocks, num_params=traced.num_params,
                             weight_bytes=traced.weight_bytes)
    ir = IRSummary(trace_context_tokens=traced.trace_context_tokens, units=traced.units,
                   shared_weights=traced.shared_weights)
    limits = Limits(gpu_memory_bytes=gpu_memory_bytes, host_memory_bytes=host_memory_bytes,
                    gpu_budget_bytes=gpu_budget, host_budget_bytes=host_budget)
    kv_settings = KVPlan(page_size_tokens=page_size_tokens, watermark=watermark, offload=kv_offload)
    model_max = model_max_tokens(data)
    objective = SEARCH_OBJECTIVE
    if max_context:
        workload, objective = _longest_workload(identity, ir, machine, workload, limits, kv_settings, calibration,
                                                model_max, latency_bound_ms, split_k)
    return _assemble(identity, ir, machine, workload, limits, kv_settings, split_k, allow_infeasible, calibration,
                     recalibration, parent, model_max, objective)


def _space(dtype: str, workload: Workload, limits: Limits, kv: KVPlan) -> SearchSpace:
    return SearchSpace(batch=workload.batch_size, context=workload.context_tokens, prompt=workload.prompt_tokens,
                       page_size_tokens=kv.page_size_tokens, watermark=kv.watermark, offload=kv.offload,
                       gpu_budget_bytes=limits.gpu_budget_bytes, host_budget_bytes=limits.host_budget_bytes,
                       dtype=dtype)


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
        raise PlanError(f"--max-context: {which} one KV page of {kv.page_size_tokens} tokens{within} on "
                        f"{machine.name}: {why}")
    if tokens < need:
        raise PlanError(f"--max-context: the longest context{within} on {machine.name} is {tokens} tokens (k={k}, "
                        f"then {why}), shorter than prompt + new tokens ({workload.prompt_tokens} + "
                        f"{workload.max_new_tokens}): lower --prompt-tokens / --max-new-tokens")
    objective = (f"the longest context {'split k=%d' % split_k if split_k is not None else 'any split'} serves"
                 f"{within} ({tokens} tokens at k={k}; one page more: {why}); at it, {SEARCH_OBJECTIVE}")
    return replace(workload, context_tokens=tokens), objective


def carry_calibration(parent: Plan, machine: MachineProfile) -> tuple[Calibration, Recalibration | None]:
    """The calibration a plan derived from `parent` for `machine` starts from. The same machine:
    all of it. Another machine: η is relative to each machine's measured rates, so it carries;
    δ is an absolute per-block cost of the machine it was fitted on, so it is kept as the best
    prior there is, but `recalibration.delta_from_other_machine` says where it came from."""
    rec = parent.recalibration
    if rec is not None:
        rec = replace(rec, delta_from_other_machine=rec.machine != machine.name)
    return parent.calibration, rec


def replan(plan: Plan, calibration: Calibration, recalibration: Recalibration | None) -> Plan:
    """The next version of `plan` with another calibration: the search re-run from the plan's own
    IR (no config or weights needed) on the same machine, workload, limits and KV settings. A
    plan whose split was forced keeps it; otherwise the calibrated model may move k."""
    p = plan.partition
    model_max = plan.longest_context.model_max_tokens if plan.longest_context is not None else None
    return _assemble(plan.model, plan.ir, plan.machine, plan.workload, plan.limits, plan.kv,
                     p.split_k if p.forced else None, True, calibration, recalibration, plan, model_max,
                     plan.search.objective)


def _assemble(identity: ModelIdentity, ir: IRSummary, machine: MachineProfile, workload: Workload,
              limits: Limits, kv_settings: KVPlan, split_k: int | None, allow_infeasible: bool,
              calibration: Calibration, recalibration: Recalibration | None, parent: Plan | None,
              model_max: int | None, objective: str) -> Plan:
    """Score every split of `ir` on `machine` and build the plan for the best (or `split_k`);
    `model_max`: the model's position limit for the longest context (None: not stated)."""
    units, shared, n = ir.units, ir.shared_weights, len(ir.units)
    space = _space(identity.dtype, workload, limits, kv_settings)
    costs = evaluate_all(units, shared, machine, space, calibration)
    best = best_split(costs)
    model_name = f"{identity.architecture} ({identity.source})"
    if split_k is not None:
        if not 0 <= split_k <= n:
            raise PlanError(f"--split {split_k} is out of range: {identity.architecture} has {n} units "
                            f"(k = units on the CPU, 0..{n})")
        chosen = costs[split_k]
        if not chosen.feasible and not allow_infeasible:
            raise PlanError(f"--split {split_k} is infeasible on {machine.name}: {chosen.reason}")
    elif best is None:
        raise PlanError(_infeasible_message(units, shared, costs, machine, model_name))
    else:
        chosen = best

    stages = tuple(StagePlan(device=s.device, unit_start=s.unit_start, unit_end=s.unit_end,
                             num_blocks=s.num_blocks, weight_bytes=s.weight_bytes) for s in chosen.stages)
    kv = chosen.kv
    plan = Plan(
        kind="plan", schema_version=PLAN_SCHEMA_VERSION,
        plan_version=(parent.plan_version + 1) if parent else 1, digest="",
        parent_digest=parent.digest if parent else None, tool_version=tool_version(),
        model=identity, machine=machine, workload=workload, limits=limits,
        partition=Partition(split_k=chosen.split_k, num_units=n, forced=split_k is not None, stages=stages),
        kv=replace(kv_settings, pages_per_sequence=kv.pages_per_sequence, device_page_bytes=kv.device_page_bytes,
                   cpu_page_bytes=kv.cpu_page_bytes, device_pages=kv.device_pages,
                   host_pages=kv.host_pages, cpu_pages=kv.cpu_pages),
        calibration=calibration,
        recalibration=recalibration,
        prediction=_prediction(chosen, workload),
        longest_context=None if model_max is None else longest_context(
            chosen.split_k, units, shared, machine, space, calibration, model_max),
        search=Search(objective=objective,
                      best_feasible_k=best.split_k if best else None,
                      candidates=tuple(_candidate(c) for c in costs)),
        ir=ir,
    )
    return _seal(plan)


def plan_for_split(model: str | Path | dict, split_k: int, machine: MachineProfile | None = None,
                   page_size_tokens: int = DEFAULT_PAGE_SIZE_TOKENS, watermark: float = DEFAULT_WATERMARK,
                   kv_offload: bool = False, workload: Workload | None = None,
                   dtype: str | None = None) -> Plan:
    """A valid plan for a given split without profiling (machine: a placeholder unless given).
    The split is scored and recorded but not required to fit (`partition.forced` is true)."""
    return make_plan(model, machine, workload=workload, page_size_tokens=page_size_tokens,
                     watermark=watermark, kv_offload=kv_offload, split_k=split_k,
                     allow_infeasible=True, dtype=dtype)


def predict(plan: Plan, context_tokens: int, batch_size: int | None = None, prefix_tokens: int = 0,
            logits: bool = True) -> Prediction:
    """The plan's cost model evaluated for one decode step at another context length / batch
    (what the executor compares its measurements against); its prefill figures are for the
    workload's prompt_tokens after `prefix_tokens` cached ones (a chunk of a longer prompt)."""
    batch = batch_size or plan.workload.batch_size
    wl = replace(plan.workload, batch_size=batch)
    cost = evaluate_split(plan.partition.split_k, plan.ir.units, plan.ir.shared_weights, plan.machine,
                          batch=batch, context=context_tokens, prompt=plan.workload.prompt_tokens,
                          page_size_tokens=plan.kv.page_size_tokens, watermark=plan.kv.watermark,
                          offload=plan.kv.offload, gpu_budget_bytes=plan.limits.gpu_budget_bytes,
                          host_budget_bytes=plan.limits.host_budget_bytes, calibration=plan.calibration,
                          prefix=prefix_tokens, dtype=plan.model.dtype, logits=logits)
    return _prediction(cost, wl, context_tokens)


def predict_ttft_ms(plan: Plan, prompt_tokens: int, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> float:
    """The plan's time to first token for a prompt of `prompt_tokens` at batch 1, prefilled the way
    the executor does it: in steps of at most chunk_tokens, each after the chunks before it, the
    logits computed by the last one only."""
    total = 0.0
    for start in range(0, prompt_tokens, chunk_tokens):
        n = min(chunk_tokens, prompt_tokens - start)
        chunk = replace(plan, workload=replace(plan.workload, prompt_tokens=n))
        total += predict(chunk, start + n, 1, prefix_tokens=start, logits=start + n == prompt_tokens).ttft_ms
    return total


def _check_workload(w: Workload) -> None:
    if w.prompt_tokens < 1:
        raise PlanError(f"--prompt-tokens must be at least 1, got {w.prompt_tokens}")
    if w.max_new_tokens < 0:
        raise PlanError(f"--max-new-tokens must be >= 0, got {w.max_new_tokens}")
    if w.batch_size < 1:
        raise PlanError(f"--batch-size must be at least 1, got {w.batch_size}")
    if w.context_tokens < w.prompt_tokens + w.max_new_tokens:
        raise PlanError(f"--context {w.context_tokens} is shorter than prompt + new tokens "
                        f"({w.prompt_tokens} + {w.max_new_tokens})")


def workload_for(prompt_tokens: int = 512, max_new_tokens: int = 512, batch_size: int = 1,
                 context_tokens: int | None = None) -> Workload:
    """A Workload whose context defaults to prompt + new tokens."""
    return Workload(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    context_tokens=context_tokens if context_tokens is not None else prompt_tokens + max_new_tokens)
