"""The measurement report (DESIGN §7-8): measured versus predicted step time per stage, phase and
context bucket, what the executor hands recalibration. The format's one owner: its types,
`to_pb`/`from_pb` (the daemon's GetReport; `pb` is the generated module, passed in), the JSON
document of schemas/report.schema.json (`to_dict`, `write`, `read_report`) and its validation.
The executor's Recorder (executor.report) fills it.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from planner.errors import PlanError
from planner.schema import validate
from planner.yamlio import read_text_file

REPORT_SCHEMA_VERSION = 1
PHASES = ("decode", "prefill")


def _ns(ms: float) -> int:
    return max(0, round(ms * 1e6))


@dataclass(frozen=True)
class PlanSummary:
    """Identity of a plan, as the daemon and its reports name it."""
    version: int
    digest: str
    parent_digest: str | None
    split_k: int
    num_units: int
    machine: str                       # the machine profile's name
    predicted_ms_per_token: float      # at the plan's workload context and batch
    source: str                        # the path the plan was loaded from, or "inline"

    @classmethod
    def of(cls, plan, source: str) -> "PlanSummary":
        return cls(plan.plan_version, plan.digest, plan.parent_digest, plan.partition.split_k,
                   plan.partition.num_units, plan.machine.name, plan.prediction.ms_per_token, source)

    def to_pb(self, pb):
        return pb.PlanSummary(version=self.version, digest=self.digest, parent_digest=self.parent_digest or "",
                              split_k=self.split_k, num_units=self.num_units, machine=self.machine,
                              predicted_ns_per_token=_ns(self.predicted_ms_per_token), source=self.source)

    @classmethod
    def from_pb(cls, msg) -> "PlanSummary":
        return cls(msg.version, msg.digest, msg.parent_digest or None, msg.split_k, msg.num_units, msg.machine,
                   msg.predicted_ns_per_token / 1e6, msg.source)


@dataclass(frozen=True)
class ReportRow:
    """Measured versus predicted time of one stage for one phase and context bucket."""
    stage: int
    device: str                        # as planned: "cpu" | "cuda"
    num_blocks: int
    phase: str                         # "decode" | "prefill"
    context_min: int                   # bucket [context_min, context_max) in tokens
    context_max: int
    samples: int                       # steps
    context_mean: float
    batch_mean: float                  # sequences per step
    tokens_mean: float                 # tokens per step
    measured_mean_ms: float
    measured_p50_ms: float
    measured_p99_ms: float
    predicted_ms: float                # mean over the same steps
    predicted_roofline_ms: float       # the same before the per-block overhead δ
    error_pct: float                   # (measured mean - predicted) / predicted * 100
    # prompt steps a CPU stage ran on the GPU, its weights streamed (a row of their own beside the
    # bucket's other prompt steps); None: not stated (a report from before the field)
    streamed: bool | None = None
    # the per-block overheads δ the model charged a step, on average: num_blocks, or more where the
    # stage took steps in sub-steps (a streamed prompt step's GPU stage); None: a report from
    # before the field (num_blocks)
    overheads_mean: float | None = None

    @property
    def kind(self) -> str:
        """The row's steps in a word: "decode", "prefill", or "streamed" (streamed prompt steps)."""
        return "streamed" if self.streamed else self.phase

    def to_pb(self, pb):
        return pb.ReportRow(
            stage=self.stage, device=_DEVICE_PB[self.device](pb), num_blocks=self.num_blocks,
            phase=_PHASE_PB[self.phase](pb), context_min=self.context_min, context_max=self.context_max,
            samples=self.samples, context_mean=self.context_mean, batch_mean=self.batch_mean,
            tokens_mean=self.tokens_mean, measured_mean_ns=_ns(self.measured_mean_ms),
            measured_p50_ns=_ns(self.measured_p50_ms), measured_p99_ns=_ns(self.measured_p99_ms),
            predicted_mean_ns=_ns(self.predicted_ms), predicted_roofline_mean_ns=_ns(self.predicted_roofline_ms),
            error_pct=self.error_pct, streamed=self.streamed, overheads_mean=self.overheads_mean)

    @classmethod
    def from_pb(cls, msg, pb) -> "ReportRow":
        return cls(msg.stage, device_name(msg.device, pb), msg.num_blocks, phase_name(msg.phase, pb),
                   msg.context_min, msg.context_max, msg.samples, msg.context_mean, msg.batch_mean,
                   msg.tokens_mean, msg.measured_mean_ns / 1e6, msg.measured_p50_ns / 1e6,
                   msg.measured_p99_ns / 1e6, msg.predicted_mean_ns / 1e6, msg.predicted_roofline_mean_ns / 1e6,
                   msg.error_pct, msg.streamed if msg.HasField("streamed") else None,
                   msg.overheads_mean if msg.HasField("overheads_mean") else None)


@dataclass(frozen=True)
class Report:
    """Measured versus predicted step time of one plan on this machine."""
    plan: PlanSummary
    architecture: str
    kernel_isa: str
    steps: int
    created_unix_ns: int
    rows: tuple[ReportRow, ...]
    # The measured load's CPU-stage prompt steps of at least this many tokens ran on the GPU, their
    # weights streamed (executor/streamed_prefill.py); 0: none did (a load may run without its
    # plan's policy: the weights could not be page-locked, say); None: not stated (a report from
    # before the field, which ran as planned). Recalibration models what ran.
    stream_prefill_min_rows: int | None = None

    def to_pb(self, pb):
        return pb.GetReportResponse(plan=self.plan.to_pb(pb), architecture=self.architecture,
                                    kernel_isa=self.kernel_isa, steps=self.steps,
                                    created_unix_ns=self.created_unix_ns, rows=[r.to_pb(pb) for r in self.rows],
                                    stream_prefill_min_rows=self.stream_prefill_min_rows)

    @classmethod
    def from_pb(cls, msg, pb) -> "Report":
        return cls(PlanSummary.from_pb(msg.plan), msg.architecture, msg.kernel_isa, msg.steps,
                   msg.created_unix_ns, tuple(ReportRow.from_pb(r, pb) for r in msg.rows),
                   msg.stream_prefill_min_rows if msg.HasField("stream_prefill_min_rows") else None)

    def to_dict(self) -> dict:
        """The JSON document of schemas/report.schema.json (ms floats rounded to 6 significant digits)."""
        created = datetime.fromtimestamp(self.created_unix_ns / 1e9, tz=timezone.utc)
        return {
            "kind": "report",
            "schema_version": REPORT_SCHEMA_VERSION,
            "created_at": created.isoformat(timespec="seconds").replace("+00:00", "Z"),
            "plan": asdict(self.plan),
            "architecture": self.architecture,
            "kernel_isa": self.kernel_isa,
            "steps": self.steps,
            **({"stream_prefill_min_rows": self.stream_prefill_min_rows} if self.stream_prefill_min_rows is not None
               else {}),
            "rows": [{k: _round(v) for k, v in asdict(r).items() if v is not None} for r in self.rows],
        }

    def table(self) -> str:
        """The report for a person: one line per row, measured next to predicted."""
        p = self.plan
        lines = [f"plan v{p.version} {p.digest[:19]}… split k={p.split_k} of {p.num_units} units, machine "
                 f"{p.machine!r}, kernels {self.kernel_isa}, {self.steps} steps",
                 f"{'stage':>5} {'device':<6} {'blocks':>6} {'phase':<8} {'context':>13} {'steps':>6} {'batch':>5} "
                 f"{'mean ms':>9} {'p50 ms':>9} {'p99 ms':>9} {'predicted':>9} {'error':>8}"]
        for r in self.rows:
            lines.append(f"{r.stage:>5} {r.device:<6} {r.num_blocks:>6} {r.kind:<8} "
                         f"{f'[{r.context_min}, {r.context_max})':>13} {r.samples:>6} {r.batch_mean:>5.3g} "
                         f"{r.measured_mean_ms:>9.4g} "
                         f"{r.measured_p50_ms:>9.4g} {r.measured_p99_ms:>9.4g} {r.predicted_ms:>9.4g} "
                         f"{r.error_pct:>+7.0f}%")
        if not self.rows:
            lines.append("(no steps measured yet)")
        return "\n".join(lines)

    def write(self, path: str | Path) -> None:
        data = self.to_dict()
        validate_report(data)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def validate_report(data: dict) -> None:
    """PlanError naming the failing field if `data` does not match schemas/report.schema.json."""
    validate(data, "report")


def _round(v):
    return float(f"{v:.6g}") if isinstance(v, float) else v


def device_name(value: int, pb) -> str:
    return {pb.DEVICE_CPU: "cpu", pb.DEVICE_CUDA: "cuda"}.get(value, "unspecified")


def phase_name(value: int, pb) -> str:
    return {pb.PHASE_DECODE: "decode", pb.PHASE_PREFILL: "prefill"}.get(value, "unspecified")


_DEVICE_PB = {"cpu": lambda pb: pb.DEVICE_CPU, "cuda": lambda pb: pb.DEVICE_CUDA}
_PHASE_PB = {"decode": lambda pb: pb.PHASE_DECODE, "prefill": lambda pb: pb.PHASE_PREFILL}


def context_bucket(context: int) -> tuple[int, int]:
    """[lo, hi): powers of two, so short contexts get fine buckets and long ones coarse."""
    lo = 1 << (max(1, context).bit_length() - 1)
    return lo, 2 * lo


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON has (a measurement is finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: JSON, but no double
        raise ValueError(f"{text[:20]} is beyond any double (a measurement is finite)")
    return value


def read_report(path: str | Path):
    """A report JSON file (helm-executor report -o ...) as a Report; PlanError when missing,
    empty, not JSON or not valid against schemas/report.schema.json."""
    path = Path(path)
    text = read_text_file(path, "report")
    if not text.strip():
        raise PlanError(f"report {path} is empty (write one with `helm-executor report --addr HOST:PORT -o {path}`)")
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise PlanError(f"report {path} is not JSON: {e}") from None
    except ValueError as e:  # NaN or Infinity, which Python's json reads but JSON has not
        raise PlanError(f"report {path}: {e}") from None
    if data in ({}, [], None):
        raise PlanError(f"report {path} is empty (write one with `helm-executor report --addr HOST:PORT -o {path}`)")
    if not isinstance(data, dict):
        raise PlanError(f"report {path}: expected a JSON object, got {type(data).__name__}")
    validate(data, "report", f"report {path}")
    try:
        created = datetime.fromisoformat(data["created_at"].replace("Z", "+00:00"))
    except ValueError:
        raise PlanError(f"report {path}: field 'created_at' is not an ISO 8601 time") from None
    if created.tzinfo is None:
        created = created.replace(tzinfo=timezone.utc)
    return Report(PlanSummary(**data["plan"]), data["architecture"], data["kernel_isa"], data["steps"],
                  round(created.timestamp() * 1e9), tuple(ReportRow(**row) for row in data["rows"]),
                  data.get("stream_prefill_min_rows"))
