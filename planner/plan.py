"""The plan: the one type the planner writes and the executor loads (DESIGN §6).

A plan is a tree of frozen dataclasses, written as deterministic YAML (field order = key order,
floats rounded to 6 significant digits) with a three-line comment header for a reviewer, and
validated against schemas/plan.schema.json on load by both users. `digest` is the sha256 of the
canonical JSON of everything else, so a hand-edited plan is detected.

    plan = load_plan("plans/qwen3-8b.laptop-rtx4060.yaml")
    plan.partition.split_k, plan.partition.stages[0].device, plan.kv.device_pages
    save_plan(plan, path); plan.to_yaml()

Reading a plan needs nothing else of the planner: making one is planner.planning, evaluating its
cost model for another step is planner.predict.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from planner.capacity import LongestContext
from planner.cost import request_ms
from planner.errors import PlanError
from planner.machine import Calibration, MachineProfile, check_machine
from planner.provenance import Recalibration
from planner.schema import validate
from planner.step_shape import PREFILL_CHUNK_TOKENS
from planner.serial import OMIT_IF_NONE, from_dict, to_dict
from planner.ir import SharedWeight, UnitIR
from planner.units import fmt_bytes
from planner.yamlio import dump_yaml, parse_yaml, read_yaml

PLAN_SCHEMA_VERSION = 1
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
    # The stage's working set beyond weights and KV (planner/working_set.py; None: a plan made
    # before it was priced)
    working_bytes: int | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class Partition:
    split_k: int                        # units on the CPU: [0, split_k) cpu, [split_k, num_units) cuda
    num_units: int                      # num_blocks + 2
    forced: bool                        # chosen with --split rather than by the search
    stages: tuple[StagePlan, ...]       # the non-empty stages, cpu first
    # Prompt steps of at least this many tokens run the CPU stage's blocks on the GPU with their
    # weights streamed over the link, where the cost model priced that faster than the CPU
    # (planner.cost.stream_prefill_min_rows; executor/streamed_prefill.py); absent: on the CPU
    stream_prefill_min_rows: int | None = field(default=None, metadata=OMIT_IF_NONE)
    # ... taking up to this many of a prompt's tokens a step (each step crosses the weights once),
    # as many as the VRAM the split leaves at the plan's context holds (planner.cost
    # ._streamed_step_tokens); absent from a plan that streams: a prompt chunk (PREFILL_CHUNK_TOKENS)
    stream_prefill_step_tokens: int | None = field(default=None, metadata=OMIT_IF_NONE)

    @property
    def streamed_step_tokens(self) -> int | None:
        """The most tokens a streamed prompt step takes (None: the plan streams none)."""
        if self.stream_prefill_min_rows is None:
            return None
        return self.stream_prefill_step_tokens or PREFILL_CHUNK_TOKENS


@dataclass(frozen=True)
class KVPlan:
    page_size_tokens: int = DEFAULT_PAGE_SIZE_TOKENS
    watermark: float = DEFAULT_WATERMARK  # offload, pages not all fitting: the VRAM share kept ones may use
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
    gpu_bytes: int                      # weights + device KV + working set
    host_bytes: int                     # CPU weights + CPU KV + offloaded pages + working set
    # the workload's prompt (None in plans made before the search weighed it: SEARCH_OBJECTIVE)
    ttft_ms: float | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class Search:
    objective: str
    best_feasible_k: int | None         # the search's answer (None: nothing feasible)
    candidates: tuple[Candidate, ...]   # every k in 0..num_units


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
        return dump_yaml(self.to_dict(), header_lines(self))


# ---- digest, load, save ----------------------------------------------------------------------

def _canonical(data: dict) -> bytes:
    body = {k: v for k, v in data.items() if k != "digest"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def plan_digest(plan_or_dict: Plan | dict) -> str:
    data = plan_or_dict if isinstance(plan_or_dict, dict) else plan_or_dict.to_dict()
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


def seal(plan: Plan) -> Plan:
    """The plan with its digest set."""
    return replace(plan, digest=plan_digest(plan))


def plan_from_dict(data: dict, what: str = "plan", verify_digest: bool = True) -> Plan:
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
    return plan_from_dict(parse_yaml(text, label), label)


def load_plan(path_or_text: str | Path, verify_digest: bool = True) -> Plan:
    """Read, schema-validate and digest-check a plan (a path or YAML text). PlanError when bad."""
    data, what = read_yaml(path_or_text, "plan")
    return plan_from_dict(data, what, verify_digest)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan's YAML (validated first, so a bad plan never reaches disk)."""
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
        work = f" + {fmt_bytes(s.working_bytes)} working set" if s.working_bytes else ""
        return (f"{s.device} units {s.unit_start}-{s.unit_end - 1} ({' + '.join(parts)}, "
                f"{fmt_bytes(s.weight_bytes)}{work})")

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
    if p.stream_prefill_min_rows is not None:
        lines.append(f"Prompt steps of >= {p.stream_prefill_min_rows} tokens run the CPU stage's blocks on the GPU, "
                     "their weights streamed over the link (priced faster than the CPU from there on), "
                     f"up to {p.streamed_step_tokens} tokens a step.")
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


def _request_s(c: Candidate, new_tokens: int) -> float:
    """A candidate's request of the workload in seconds (SplitCost.request_ms, from its rounded figures)."""
    return request_ms(c.ttft_ms, c.total_ms, new_tokens) / 1e3


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
        elif c.total_ms is not None and c.ttft_ms is not None and cands[k].ttft_ms is not None:
            new = plan.workload.max_new_tokens
            mine, theirs = _request_s(cands[k], new), _request_s(c, new)
            how = "as fast (ties: the larger k)" if theirs == mine else "slower"
            notes.append(f"k={k - 1} serves the workload's request {how}: TTFT {c.ttft_ms:g} ms + {new - 1} x "
                         f"{c.total_ms:g} ms/token = {theirs:.4g} s, against {mine:.4g} s")
        elif c.total_ms is not None:
            notes.append(f"k={k - 1} is slower ({c.total_ms:g} ms/token)")
    else:
        notes.append("everything fits on the GPU")
    allcpu = cands[n]
    if k != n and allcpu.total_ms is not None:
        notes.append(f"all-CPU would take {allcpu.total_ms:g} ms/token"
                     f"{'' if allcpu.feasible else ' (and is infeasible)'}")
    return "; ".join(notes) + "."
