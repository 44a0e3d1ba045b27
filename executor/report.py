"""Measured versus predicted step time (DESIGN §7-8): what the executor hands recalibration.

Every engine step gives, per stage, the measured wall time with the step's phase, context
length, batch and tokens; `Recorder` pairs it with the time the plan's cost model predicts for
that same step (`planner.plan.predict`) and aggregates per stage, phase and power-of-two context
bucket. `Report` is the result: `to_pb`/`from_pb` for the daemon's GetReport, `to_dict`/`write`
for the JSON file that `schemas/report.schema.json` defines.
"""
from __future__ import annotations

import functools
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

REPORT_SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "report.schema.json"
PERCENTILE_SAMPLE = 4096  # steps kept per row for p50/p99 (a uniform reservoir); means use every step
PHASES = ("decode", "prefill")
DEVICES = ("cpu", "cuda")


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

    def to_pb(self, pb):
        return pb.ReportRow(
            stage=self.stage, device=_DEVICE_PB[self.device](pb), num_blocks=self.num_blocks,
            phase=_PHASE_PB[self.phase](pb), context_min=self.context_min, context_max=self.context_max,
            samples=self.samples, context_mean=self.context_mean, batch_mean=self.batch_mean,
            tokens_mean=self.tokens_mean, measured_mean_ns=_ns(self.measured_mean_ms),
            measured_p50_ns=_ns(self.measured_p50_ms), measured_p99_ns=_ns(self.measured_p99_ms),
            predicted_mean_ns=_ns(self.predicted_ms), predicted_roofline_mean_ns=_ns(self.predicted_roofline_ms),
            error_pct=self.error_pct)

    @classmethod
    def from_pb(cls, msg, pb) -> "ReportRow":
        return cls(msg.stage, device_name(msg.device, pb), msg.num_blocks, phase_name(msg.phase, pb),
                   msg.context_min, msg.context_max, msg.samples, msg.context_mean, msg.batch_mean,
                   msg.tokens_mean, msg.measured_mean_ns / 1e6, msg.measured_p50_ns / 1e6,
                   msg.measured_p99_ns / 1e6, msg.predicted_mean_ns / 1e6, msg.predicted_roofline_mean_ns / 1e6,
                   msg.error_pct)


@dataclass(frozen=True)
class Report:
    """Measured versus predicted step time of one plan on this machine."""
    plan: PlanSummary
    architecture: str
    kernel_isa: str
    steps: int
    created_unix_ns: int
    rows: tuple[ReportRow, ...]

    def to_pb(self, pb):
        return pb.GetReportResponse(plan=self.plan.to_pb(pb), architecture=self.architecture,
                                    kernel_isa=self.kernel_isa, steps=self.steps,
                                    created_unix_ns=self.created_unix_ns, rows=[r.to_pb(pb) for r in self.rows])

    @classmethod
    def from_pb(cls, msg, pb) -> "Report":
        return cls(PlanSummary.from_pb(msg.plan), msg.architecture, msg.kernel_isa, msg.steps,
                   msg.created_unix_ns, tuple(ReportRow.from_pb(r, pb) for r in msg.rows))

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
            "rows": [{k: _round(v) for k, v in asdict(r).items()} for r in self.rows],
        }

    def table(self) -> str:
        """The report for a person: one line per row, measured next to predicted."""
        p = self.plan
        lines = [f"plan v{p.version} {p.digest[:19]}… split k={p.split_k} of {p.num_units} units, machine "
                 f"{p.machine!r}, kernels {self.kernel_isa}, {self.steps} steps",
                 f"{'stage':>5} {'device':<6} {'blocks':>6} {'phase':<7} {'context':>13} {'steps':>6} {'batch':>5} "
                 f"{'mean ms':>9} {'p50 ms':>9} {'p99 ms':>9} {'predicted':>9} {'error':>8}"]
        for r in self.rows:
            lines.append(f"{r.stage:>5} {r.device:<6} {r.num_blocks:>6} {r.phase:<7} "
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


def kernel_isa(model) -> str:
    """The CPU kernels a loaded model uses, with their instruction set: it belongs with every
    measurement ("helm-avx512", "torch", or "none" without a CPU stage)."""
    backends = {s.backend for s in model.stages if s.device.type == "cpu"}
    if "helm" in backends:
        from executor.kernels import KERNEL_ISA

        return f"helm-{KERNEL_ISA}"
    return "torch" if backends else "none"


def validate_report(data: dict) -> None:
    """Raise ValueError naming the failing field if `data` does not match the report schema."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "<top>"
        raise ValueError(f"report.schema.json violation at field '{where}': {error.message}")


def _round(v):
    return float(f"{v:.6g}") if isinstance(v, float) else v


def device_name(value: int, pb) -> str:
    return {pb.DEVICE_CPU: "cpu", pb.DEVICE_CUDA: "cuda"}.get(value, "unspecified")


def phase_name(value: int, pb) -> str:
    return {pb.PHASE_DECODE: "decode", pb.PHASE_PREFILL: "prefill"}.get(value, "unspecified")


_DEVICE_PB = {"cpu": lambda pb: pb.DEVICE_CPU, "cuda": lambda pb: pb.DEVICE_CUDA}
_PHASE_PB = {"decode": lambda pb: pb.PHASE_DECODE, "prefill": lambda pb: pb.PHASE_PREFILL}


# ---- recording -------------------------------------------------------------------------------

def context_bucket(context: int) -> tuple[int, int]:
    """[lo, hi): powers of two, so short contexts get fine buckets and long ones coarse."""
    lo = 1 << (max(1, context).bit_length() - 1)
    return lo, 2 * lo


@dataclass(frozen=True)
class StagePredicted:
    ms: float                          # roofline + n_blocks·δ (+ the link for the receiving stage)
    roofline_ms: float


class _Row:
    """Running sums of one (stage, phase, bucket) plus a reservoir of measured times."""

    def __init__(self, rng: random.Random):
        self.n = 0
        self.sums = [0.0] * 6  # measured, predicted, roofline, context, batch, tokens
        self.sample: list[float] = []
        self._rng = rng

    def add(self, measured, predicted, roofline, context, batch, tokens) -> None:
        self.n += 1
        for i, v in enumerate((measured, predicted, roofline, context, batch, tokens)):
            self.sums[i] += v
        if len(self.sample) < PERCENTILE_SAMPLE:
            self.sample.append(measured)
        else:
            j = self._rng.randrange(self.n)
            if j < PERCENTILE_SAMPLE:
                self.sample[j] = measured


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Recorder:
    """Measured and predicted time of every step of one plan. `record` runs on the engine
    thread, `report` on any thread."""

    def __init__(self, plan, source: str, architecture: str, kernel_isa: str):
        self.plan = plan
        self.summary = PlanSummary.of(plan, source)
        self.architecture = architecture
        self.kernel_isa = kernel_isa
        self._stages = plan.partition.stages
        self._rows: dict[tuple[int, str, int], _Row] = {}
        self._steps = 0
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self.predict = functools.lru_cache(maxsize=4096)(self._predict)

    def _predict(self, phase: str, context: int, batch: int, tokens: int) -> tuple[StagePredicted, ...]:
        """The cost model's time per stage for one step. Decode: `batch` sequences at mean context
        `context`. Prefill (a step with prompt chunks): the plan's prefill estimate for `batch`
        chunks of tokens/batch tokens each, ending at `context` on average, so each after the
        cached prefix that implies (the step's decodes, a few tokens, are left out). The link term
        goes to the stage that receives the hidden state (it measures the copy)."""
        from planner.plan import predict

        if phase == "decode":
            pred = predict(self.plan, context, batch)
            stages = [(s.ms_per_token, s.roofline_ms_per_token) for s in pred.stages]
            link = pred.comm_ms_per_token
        else:
            chunk = max(1, round(tokens / batch))
            plan = replace(self.plan, workload=replace(self.plan.workload, prompt_tokens=chunk))
            pred = predict(plan, max(context, 1), batch, prefix_tokens=max(0, context - chunk))
            stages = [(s.prefill_ms, s.prefill_ms - s.overhead_ms_per_token) for s in pred.stages]
            link = max(0.0, pred.ttft_ms - sum(s.prefill_ms for s in pred.stages))
        return tuple(StagePredicted(ms + (link if i else 0.0), roof + (link if i else 0.0))
                     for i, (ms, roof) in enumerate(stages))

    def record(self, phase: str, context: int, batch: int, tokens: int,
               measured_ms: tuple[float, ...]) -> tuple[StagePredicted, ...]:
        """Store one step (measured ms per stage); return what the plan predicted for it."""
        predicted = self.predict(phase, context, batch, tokens)
        lo, _ = context_bucket(context)
        with self._lock:
            self._steps += 1
            for i, (ms, p) in enumerate(zip(measured_ms, predicted)):
                row = self._rows.get((i, phase, lo))
                if row is None:
                    row = self._rows[(i, phase, lo)] = _Row(self._rng)
                row.add(ms, p.ms, p.roofline_ms, context, batch, tokens)
        return predicted

    def report(self) -> Report:
        rows = []
        with self._lock:
            order = sorted(self._rows, key=lambda key: (key[0], PHASES.index(key[1]), key[2]))
            for (i, phase, lo), row in ((key, self._rows[key]) for key in order):
                measured, predicted, roofline, context, batch, tokens = (s / row.n for s in row.sums)
                stage = self._stages[i]
                rows.append(ReportRow(
                    stage=i, device=stage.device, num_blocks=stage.num_blocks, phase=phase, context_min=lo,
                    context_max=2 * lo, samples=row.n, context_mean=context, batch_mean=batch, tokens_mean=tokens,
                    measured_mean_ms=measured, measured_p50_ms=_percentile(row.sample, 0.5),
                    measured_p99_ms=_percentile(row.sample, 0.99), predicted_ms=predicted,
                    predicted_roofline_ms=roofline,
                    error_pct=(measured - predicted) / predicted * 100 if predicted > 0 else 0.0))
            steps = self._steps
        return Report(self.summary, self.architecture, self.kernel_isa, steps, time.time_ns(), tuple(rows))
