"""Recalibration (DESIGN §8): fit the cost model's δ and η_kv per device to the executor's
measured step times, and write the next version of the plan.

Input is the daemon's measurement report (schemas/report.schema.json), from a file or live over
gRPC: per stage, phase and power-of-two context bucket, the mean measured step time and what the
measured plan predicted for the same steps. Output is the plan's next version (plan_version + 1,
the parent's digest, the fitted calibration, a `recalibration` section with the provenance and
residuals of the fit, the refreshed prediction and the search re-run, which may move k).

The model fitted to each device's decode rows is DESIGN §8's

    T̂(row) = T_roofline(row; η_kv) + n_blocks · δ  (+ T_comm for the stage that receives the hidden state)

with η_kv the efficiency of KV reads relative to the weight reads' η_m (planner/cost.py: the
attention term reads W_kv at M̂·η_m·η_kv). With one split measured, a uniform inefficiency of the
weight reads adds the same time to every block, exactly what δ describes, so δ absorbs it; what
only a KV-specific factor can describe is how time grows with context (DESIGN §8 fits one η_m for
both: on helm-dev the two reads ran at ~90% and ~40% of the profiled bandwidth, which one factor
cannot follow). η_m is fitted only where δ cannot describe the level: when the model without any
overhead already over-predicts (δ would be negative: the profile caught the machine in a slow
moment), δ is held at 0 and η_m raised by the factor that fits, in closed form like δ.

T_roofline is planner.cost evaluated at the row's mean context and batch (and scaled by the
ratio of the report's own roofline prediction to that value, so a row whose steps had varying
batch or context is anchored to what the executor predicted for exactly those steps). δ enters
linearly; η_kv (only when the device has at least MIN_BUCKETS_FOR_ETA context buckets: the
growth of time with context is what separates η_kv from δ) by a 1-D search on a log grid refined
by golden section, with δ >= 0 solved in closed form for each η_kv (variable projection). η_kv is
kept (δ fitted alone) when the buckets do not pin it to ±ETA_MAX_REL_STDERR: it is told apart
from δ only by how time grows with context, and where the KV read is a small part of the step
the two are collinear. The loss is the sum of squared *relative* errors (every bucket counts the
same, as the targets are per-bucket percentages), made robust by iteratively reweighted least
squares — Huber weights, then Tukey's bisquare on the MAD scale — so one disturbed bucket
(another process on the machine) gets no say.
Prefill rows are shown but not fitted: TTFT is compute-bound and depends on η_c, which is not fitted.

    report = read_report("report.json")          # or fetch_report("127.0.0.1:50051", plan.digest)
    result = recalibrate(plan, report, "report report.json")
    result.plan                                   # the next version; format_table(result) for a person
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable

from planner.cost import evaluate_split
from planner.errors import PlanError
from planner.machine import Calibration
from planner.plan import DeviceFit, FitResidual, MeasurementSource, Plan, Recalibration, replan
from planner.units import round_sig
from planner.yamlio import read_text_file

MIN_ROW_SAMPLES = 5           # decode steps a report row needs to enter the fit
MIN_STAGE_SAMPLES = 20        # decode steps (in usable rows) every stage needs: fewer is "too few samples"
MIN_BUCKETS_FOR_ETA = 3       # context buckets a device needs before η_kv is fitted
ETA_MIN, ETA_MAX = 0.02, 4.0  # η_kv search interval (the plan schema allows (0, 4])
ETA_M_MAX = 4.0               # η_m ceiling when fitted (machine schema: (0, 4])
ETA_GRID_POINTS = 97          # log-spaced starting grid for η_kv, then golden section
HUBER_K = 1.345               # Huber threshold in robust standard deviations (95% efficiency)
BISQUARE_C = 4.685            # Tukey bisquare cut-off after the Huber start: rows beyond it get weight 0
SIGMA_FLOOR = 0.005           # robust scale floor (0.5% relative error): exact data is not "all outliers"
MAX_IRLS_ITERATIONS = 30
NOMINAL_NOISE = 0.01          # relative noise of a bucket mean assumed at least when judging η_kv's precision
ETA_MAX_REL_STDERR = 0.10     # η_kv is fitted only if the buckets pin it to ±10% (else δ alone, η_kv kept)
TARGET_ERROR_PCT = 5.0        # per-bucket error the calibrated model should reach (issue 6); notes say when not

METHOD = (f"robust least squares per device on decode rows: minimise Σ ρ((measured - T̂)/measured) with "
          f"T̂ = T_roofline(η_kv) + n_blocks·δ (+ link); δ >= 0 in closed form (where it would be < 0: δ = 0 "
          f"and the η_m that fits, also in closed form); η_kv by log-grid + golden section "
          f"when >= {MIN_BUCKETS_FOR_ETA} context buckets pin it to ±{ETA_MAX_REL_STDERR:.0%} (else kept); IRLS, "
          f"Huber k={HUBER_K} then Tukey bisquare c={BISQUARE_C}, MAD scale; rows need >= {MIN_ROW_SAMPLES} steps")


# ---- the report: read, fetch, check ------------------------------------------------------------

def read_report(path: str | Path):
    """A report JSON file (helm-executor report -o ...) as executor.report.Report; PlanError when
    missing, empty, not JSON or not valid against schemas/report.schema.json."""
    from executor.report import PlanSummary, Report, ReportRow, validate_report

    path = Path(path)
    text = read_text_file(path, "report")
    if not text.strip():
        raise PlanError(f"report {path} is empty (write one with `helm-executor report --addr HOST:PORT -o {path}`)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"report {path} is not JSON: {e}") from None
    if data in ({}, [], None):
        raise PlanError(f"report {path} is empty (write one with `helm-executor report --addr HOST:PORT -o {path}`)")
    if not isinstance(data, dict):
        raise PlanError(f"report {path}: expected a JSON object, got {type(data).__name__}")
    try:
        validate_report(data)
    except ValueError as e:
        raise PlanError(f"report {path}: {e}") from None
    created = datetime.fromisoformat(data["created_at"].replace("Z", "+00:00"))
    if created.tzinfo is None:
        created = created.replace(tzinfo=timezone.utc)
    return Report(PlanSummary(**data["plan"]), data["architecture"], data["kernel_isa"], data["steps"],
                  round(created.timestamp() * 1e9), tuple(ReportRow(**row) for row in data["rows"]))


_ADDR = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def check_addr(addr: str) -> str:
    if not _ADDR.match(addr) or not 0 < int(addr.rsplit(":", 1)[1]) < 65536:
        raise PlanError(f"--executor {addr!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return addr


def _rpc_error(addr: str, what: str, e) -> PlanError:
    import grpc

    code, details = e.code(), (e.details() or "").strip()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return PlanError(f"cannot reach the executor daemon at {addr} ({what}): {code.name}: "
                         f"{' '.join(details.split())[:300]}; is `helm-executor serve` running there?")
    return PlanError(f"the executor daemon at {addr} refused {what}: {code.name}: {' '.join(details.split())}")


def fetch_report(addr: str, plan: Plan, timeout_s: float = 30.0):
    """The live report of `plan` from the daemon at `addr` (GetReport with the plan's digest)."""
    import grpc

    from executor.server.client import ExecutorClient

    check_addr(addr)
    with ExecutorClient(addr) as client:
        try:
            return client.report(plan_digest=plan.digest, timeout_s=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise PlanError(f"the executor daemon at {addr} has no measurements of this plan (v{plan.plan_version} "
                                f"{plan.digest[:19]}…): {' '.join((e.details() or '').split())}; load it "
                                f"(LoadPlan, or `helm-executor serve --plan`) and send requests first") from None
            raise _rpc_error(addr, "GetReport", e) from None


def apply_plan(addr: str, plan: Plan, timeout_s: float = 600.0) -> str:
    """LoadPlan the plan (inline YAML) into the daemon at `addr` and confirm it serves it.
    Returns a one-line confirmation."""
    import grpc

    from executor.server.client import ExecutorClient

    with ExecutorClient(addr) as client:
        try:
            loaded = client.load_plan(yaml=plan.to_yaml(), timeout_s=timeout_s)
            serving = client.get_plan(timeout_s=30.0)
        except grpc.RpcError as e:
            raise _rpc_error(addr, "LoadPlan", e) from None
    if loaded.plan.digest != plan.digest or serving.plan.digest != plan.digest:
        raise PlanError(f"the executor daemon at {addr} did not confirm the new plan: it loaded "
                        f"{loaded.plan.digest[:19]}… and serves {serving.plan.digest[:19]}…, "
                        f"not {plan.digest[:19]}…")
    previous = f", replacing {loaded.previous_digest[:19]}…" if loaded.previous_digest else ""
    return (f"applied: the daemon at {addr} serves plan v{serving.plan.version} {plan.digest[:19]}… "
            f"(split k={serving.plan.split_k}{previous}; load {loaded.load_ns / 1e9:.1f} s, "
            f"warm-up {loaded.warmup_ns / 1e9:.1f} s)")


def check_report(plan: Plan, report, label: str = "the report") -> None:
    """The report must measure this very plan (digest), the same model and partition."""
    rp = report.plan
    if rp.digest != plan.digest:
        raise PlanError(
            f"{label} measured another plan: v{rp.version} {rp.digest[:19]}… (machine {rp.machine!r}, "
            f"split k={rp.split_k}), not this plan v{plan.plan_version} {plan.digest[:19]}… (machine "
            f"{plan.machine.name!r}, split k={plan.partition.split_k}); recalibrate the plan it measured, "
            f"or measure this one (helm-executor report --addr HOST:PORT fetches the plan now serving)")
    if report.architecture != plan.model.architecture:
        raise PlanError(f"{label} measured a {report.architecture} model; the plan is for {plan.model.architecture}")
    if (rp.split_k, rp.num_units, rp.machine) != (plan.partition.split_k, plan.partition.num_units, plan.machine.name):
        raise PlanError(f"{label} names the plan's digest but not its partition or machine: k={rp.split_k} of "
                        f"{rp.num_units} units on {rp.machine!r} (the plan: k={plan.partition.split_k} of "
                        f"{plan.partition.num_units} on {plan.machine.name!r}); the report was edited")
    stages = plan.partition.stages
    for row in report.rows:
        if row.stage >= len(stages) or stages[row.stage].device != row.device \
                or stages[row.stage].num_blocks != row.num_blocks:
            raise PlanError(f"{label}: row for stage {row.stage} ({row.device}, {row.num_blocks} blocks) does not "
                            f"match the plan's stages "
                            f"{[(s.device, s.num_blocks) for s in stages]}")
    if not report.rows:
        raise PlanError(f"{label} has no measurements: the daemon has not run a step of this plan yet; "
                        "send it requests first")


# ---- the cost model of one report row, as a function of η_kv ------------------------------------

def _with(calibration: Calibration, device: str, **values) -> Calibration:
    dev = replace(calibration.for_device(device), **values)
    return replace(calibration, **{device: dev})


def _stage_roofline_ms(plan: Plan, calibration: Calibration, stage: int, phase: str,
                       context: float, batch: float, tokens: float) -> tuple[float, float]:
    """What the executor's Recorder predicts for one step before n_blocks·δ, as (the stage's own
    roofline, the link term): the stage's decode roofline at (context, batch) — or its prefill
    roofline for `tokens` prompt tokens — and the link on the stage that receives the hidden state."""
    decode = phase == "decode"
    cost = evaluate_split(plan.partition.split_k, plan.ir.units, plan.ir.shared_weights, plan.machine,
                          batch=batch if decode else 1, context=context if decode else max(context, 1.0),
                          prompt=plan.workload.prompt_tokens if decode else tokens,
                          page_size_tokens=plan.kv.page_size_tokens, watermark=plan.kv.watermark,
                          offload=plan.kv.offload, gpu_budget_bytes=plan.limits.gpu_budget_bytes,
                          host_budget_bytes=plan.limits.host_budget_bytes, calibration=calibration)
    s = cost.stages[stage]
    if decode:
        return s.roofline_ms, (cost.comm_ms if stage else 0.0)
    return s.prefill_ms - s.overhead_ms, (cost.comm_prefill_ms if stage else 0.0)


class _RowModel:
    """One report row and T_roofline(η_kv, η_m) for it, anchored to the report's own roofline prediction.

    η_m enters as `scale` = η_m(measured plan) / η_m: the stage's roofline (not the link) times
    scale. That is exact where the stage's step is bound by its reads, as decode steps are; the
    table and the written plan's prediction use the cost model itself at the fitted η_m."""

    def __init__(self, plan: Plan, row):
        self.row = row
        self.device = row.device
        self.blocks = row.num_blocks
        self.measured = row.measured_mean_ms
        self._plan = plan
        self._cal = plan.calibration
        self.eta_m0 = self._cal.for_device(row.device).eta_memory
        stage, link = self._raw(self._cal.for_device(row.device).eta_kv, self.eta_m0)
        # The report's roofline is the mean over the row's steps; the model at the mean context
        # and batch differs from it only where the roofline bends within the bucket.
        base = stage + link
        self.ratio = row.predicted_roofline_ms / base if base > 0 and row.predicted_roofline_ms > 0 else 1.0
        self._cache: dict[tuple[float, float], tuple[float, float]] = {}

    def _raw(self, eta: float, eta_m: float) -> tuple[float, float]:
        cal = _with(self._cal, self.device, eta_kv=eta, eta_memory=eta_m)
        r = self.row
        return _stage_roofline_ms(self._plan, cal, r.stage, r.phase, r.context_mean, r.batch_mean, r.tokens_mean)

    def parts(self, eta: float, eta_m: float | None = None) -> tuple[float, float]:
        """(stage roofline, link) in ms at η_kv = eta and η_m (default: the measured plan's)."""
        key = (eta, self.eta_m0 if eta_m is None else eta_m)
        if key not in self._cache:
            stage, link = self._raw(*key)
            self._cache[key] = (self.ratio * stage, self.ratio * link)
        return self._cache[key]

    def roofline(self, eta: float, scale: float = 1.0) -> float:
        stage, link = self.parts(eta)
        return scale * stage + link

    def predict(self, eta: float, delta: float, scale: float = 1.0) -> float:
        return self.roofline(eta, scale) + self.blocks * delta

    def predict_at(self, eta: float, delta: float, eta_m: float) -> float:
        """The cost model itself at (η_kv, δ, η_m): what the written plan predicts for this row."""
        stage, link = self.parts(eta, eta_m)
        return stage + link + self.blocks * delta


# ---- the fit -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Solution:
    delta: float
    eta: float
    scale: float                     # η_m(measured plan) / η_m: 1 unless δ was held at 0
    weights: tuple[float, ...]       # robust weights of the final iteration (bisquare; 0: left out)
    residuals: tuple[float, ...]     # relative: (measured - T̂) / measured
    delta_clamped: bool              # δ < 0 wanted: held at 0, η_m fitted instead (`scale`)


def _level_for(rows: list[_RowModel], eta: float, w: list[float], delta_free: bool,
               delta0: float) -> tuple[float, float, bool]:
    """The level of the prediction for a fixed η_kv, in closed form (weighted least squares on
    relative residuals): δ >= 0, or — where the model without any overhead already over-predicts
    — δ = 0 and η_m raised by the factor that fits (the profile caught the machine reading slower
    than it does now). Returns (δ, scale = η_m(old)/η_m(new), δ held at 0)."""
    if not delta_free:
        return delta0, 1.0, False
    num = den = 0.0
    for r, wi in zip(rows, w):
        v = wi / r.measured ** 2
        num += v * r.blocks * (r.measured - r.roofline(eta))
        den += v * r.blocks ** 2
    if den <= 0:
        return delta0, 1.0, False
    if num >= 0:
        return num / den, 1.0, False
    num = den = 0.0
    for r, wi in zip(rows, w):
        v = wi / r.measured ** 2
        stage, link = r.parts(eta)
        num += v * stage * (r.measured - link)
        den += v * stage * stage
    scale = num / den if den > 0 else 1.0
    lowest = min(r.eta_m0 for r in rows) / ETA_M_MAX
    return 0.0, min(1.0, max(scale, lowest)), True


def _loss(rows: list[_RowModel], eta: float, w: list[float], delta_free: bool, delta0: float) -> float:
    delta, scale, _ = _level_for(rows, eta, w, delta_free, delta0)
    return sum(wi * ((r.measured - r.predict(eta, delta, scale)) / r.measured) ** 2 for r, wi in zip(rows, w))


def _argmin_log(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Minimise f over [lo, hi]: a log-spaced grid, then golden section around the best point."""
    grid = [lo * (hi / lo) ** (i / (ETA_GRID_POINTS - 1)) for i in range(ETA_GRID_POINTS)]
    values = [f(x) for x in grid]
    i = min(range(len(grid)), key=values.__getitem__)
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    while b - a > 1e-7:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    x = math.exp((a + b) / 2)
    return min((x, grid[i]), key=f)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _robust_weights(res: list[float], bisquare: bool) -> list[float]:
    scale = max(1.4826 * _median([abs(x) for x in res]), SIGMA_FLOOR)
    if bisquare:
        return [(1 - (x / (BISQUARE_C * scale)) ** 2) ** 2 if abs(x) < BISQUARE_C * scale else 0.0 for x in res]
    return [min(1.0, HUBER_K * scale / abs(x)) if x else 1.0 for x in res]


def _solve(rows: list[_RowModel], fit_eta: bool, eta0: float, delta_free: bool, delta0: float) -> _Solution:
    """IRLS around the variable-projection fit: Huber weights to convergence (a safe start), then
    Tukey's bisquare, which gives a grossly disturbed bucket no weight at all (Huber only caps it,
    and with δ and η_kv nearly collinear even a capped outlier moves them)."""
    w = [1.0] * len(rows)
    eta = eta0
    for bisquare in (False, True):
        for _ in range(MAX_IRLS_ITERATIONS):
            if fit_eta:
                eta = _argmin_log(lambda e: _loss(rows, e, w, delta_free, delta0), ETA_MIN, ETA_MAX)
            delta, scale, _ = _level_for(rows, eta, w, delta_free, delta0)
            new_w = _robust_weights([(r.measured - r.predict(eta, delta, scale)) / r.measured for r in rows],
                                    bisquare)
            done = max(abs(a - b) for a, b in zip(w, new_w)) < 1e-6
            w = new_w
            if done:
                break
    if fit_eta:
        eta = _argmin_log(lambda e: _loss(rows, e, w, delta_free, delta0), ETA_MIN, ETA_MAX)
    delta, scale, clamped = _level_for(rows, eta, w, delta_free, delta0)
    res = tuple((r.measured - r.predict(eta, delta, scale)) / r.measured for r in rows)
    return _Solution(delta, eta, scale, tuple(w), res, clamped)


def _stderrs(rows: list[_RowModel], sol: _Solution, fit_eta: bool, delta_free: bool,
             min_sigma: float = 0.0) -> dict[str, float]:
    """Standard errors of the fitted parameters — "delta" (δ, or "scale" where δ was held at 0
    and η_m fitted) and "eta" (η_kv) — from the weighted Jacobian of the relative residuals, at
    the residuals' own scale (or `min_sigma` if larger). Missing where not estimable; inf where
    the two cannot be told apart."""
    params = []
    if delta_free:
        params.append("scale" if sol.delta_clamped else "delta")
    if fit_eta:
        params.append("eta")
    dof = sum(1 for w in sol.weights if w > 0) - len(params)
    if not params or dof <= 0:
        return {}
    h = sol.eta * 1e-4
    jac = []
    for r in rows:
        g = []
        if "delta" in params:
            g.append(r.blocks / r.measured)
        if "scale" in params:
            g.append(r.parts(sol.eta)[0] / r.measured)
        if "eta" in params:
            g.append((r.predict(sol.eta + h, sol.delta, sol.scale) - r.predict(sol.eta - h, sol.delta, sol.scale))
                     / (2 * h) / r.measured)
        jac.append(g)
    p = len(params)
    jtj = [[sum(w * jac[i][a] * jac[i][b] for i, w in enumerate(sol.weights)) for b in range(p)] for a in range(p)]
    sigma2 = max(sum(w * x * x for w, x in zip(sol.weights, sol.residuals)) / dof, min_sigma ** 2)
    if p == 1:
        if jtj[0][0] <= 0:
            return {params[0]: math.inf}
        inv = [[1 / jtj[0][0]]]
    else:
        det = jtj[0][0] * jtj[1][1] - jtj[0][1] * jtj[1][0]
        if det <= 1e-12 * jtj[0][0] * jtj[1][1]:   # collinear: η_kv and the level explain the same thing
            return {name: math.inf for name in params}
        inv = [[jtj[1][1] / det, -jtj[0][1] / det], [-jtj[1][0] / det, jtj[0][0] / det]]
    return {name: math.sqrt(max(sigma2 * inv[i][i], 0.0)) for i, name in enumerate(params)}


def _rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else 0.0


def _pct(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted * 100 if predicted > 0 else 0.0


@dataclass(frozen=True)
class TableRow:
    """One report row for the before/after table."""
    stage: int
    device: str
    phase: str
    context_min: int
    context_max: int
    samples: int
    measured_ms: float
    before_ms: float
    after_ms: float
    status: str                      # "fitted" | "outlier (weight 0.31)" | "too few steps" | "not fitted"

    @property
    def error_before_pct(self) -> float:
        return _pct(self.measured_ms, self.before_ms)

    @property
    def error_after_pct(self) -> float:
        return _pct(self.measured_ms, self.after_ms)


@dataclass(frozen=True)
class RecalibrationResult:
    parent: Plan
    plan: Plan                       # the next version
    fits: tuple[DeviceFit, ...]
    rows: tuple[TableRow, ...]       # every report row, in report order
    source: str


def fit_device(plan: Plan, device: str, rows: list,
               eta_fit_allowed: bool = True) -> tuple[DeviceFit, _Solution, list[_RowModel]]:
    """Fit δ (and η_kv with enough buckets) of one device to its usable decode rows."""
    models = [_RowModel(plan, r) for r in rows]
    current = plan.calibration.for_device(device)
    buckets = len({r.context_min for r in rows})
    fit_eta = eta_fit_allowed and buckets >= MIN_BUCKETS_FOR_ETA
    delta_free = any(m.blocks for m in models)
    notes = []
    sol = _solve(models, fit_eta, current.eta_kv, delta_free, current.delta_ms_per_block)
    if fit_eta:
        # η_kv is told apart from δ only by how the step time grows with context (the KV read);
        # where that is a small or compute-bound part of the step, the two are collinear and
        # η_kv would be noise: keep it, fit δ alone.
        se = _stderrs(models, sol, True, delta_free, NOMINAL_NOISE).get("eta")
        if se is None or not math.isfinite(se) or se / sol.eta > ETA_MAX_REL_STDERR:
            spread = "cannot be told apart from δ" if se is None or not math.isfinite(se) \
                else f"would be ±{se / sol.eta * 100:.0f}%"
            notes.append(f"η_kv kept at {current.eta_kv:g}: these buckets do not pin it down ({spread}; the "
                         "KV read is too small a part of the step, or compute-bound)")
            fit_eta = False
            sol = _solve(models, False, current.eta_kv, delta_free, current.delta_ms_per_block)
    se = _stderrs(models, sol, fit_eta, delta_free)
    eta_m = round_sig(current.eta_memory / sol.scale) if sol.delta_clamped else current.eta_memory
    # the scale's standard error, as one of η_m = η_m(old) / scale
    se_eta_m = se["scale"] * current.eta_memory / sol.scale ** 2 if "scale" in se else None
    if not fit_eta and buckets < MIN_BUCKETS_FOR_ETA:
        notes.append(f"η_kv kept at {current.eta_kv:g}: {buckets} context bucket{'s' if buckets != 1 else ''}, "
                     f"it needs >= {MIN_BUCKETS_FOR_ETA}")
    elif fit_eta and min(abs(math.log(sol.eta / ETA_MIN)), abs(math.log(ETA_MAX / sol.eta))) < 0.01:
        notes.append(f"η_kv ran to the end of its range ({sol.eta:.3g}): the roofline's shape does not match "
                     "these measurements")
    if not delta_free:
        notes.append("the stage has no transformer blocks: δ does not apply")
    elif sol.delta_clamped:
        notes.append(f"δ held at 0 and η_m fitted ({current.eta_memory:g} -> {eta_m:g}): the model without "
                     "any overhead already over-predicts, so this machine reads faster than its profile measured")
    before = [_pct(m.measured, m.row.predicted_ms) for m in models]
    after = [_pct(m.measured, m.predict_at(sol.eta, sol.delta, eta_m)) for m in models]
    worst = max(abs(x) for x in after)
    kept = [(m.row.context_mean, e) for m, e, w in zip(models, after, sol.weights) if w > 0]
    if worst > TARGET_ERROR_PCT and len(kept) >= 3:
        ordered = sorted(kept)
        half = len(ordered) // 2
        low = sum(e for _, e in ordered[:half]) / half
        high = sum(e for _, e in ordered[-half:]) / half
        if high - low > TARGET_ERROR_PCT:
            notes.append(f"residuals grow with context ({low:+.1f}% short, {high:+.1f}% long): attention costs "
                         "more per KV byte than the memory roofline allows; one η_kv cannot fit weight and KV reads")
        elif low - high > TARGET_ERROR_PCT:
            notes.append(f"residuals shrink with context ({low:+.1f}% short, {high:+.1f}% long): the KV term is "
                         "over-predicted relative to the weight reads")
        else:
            notes.append(f"residuals up to {worst:.1f}% without a trend in context: noisy measurements "
                         "(a busy machine?); measure more steps")
    if any(w == 0 for w in sol.weights):
        notes.append(f"{sum(1 for w in sol.weights if w == 0)} bucket(s) left out as outliers")
    fit = DeviceFit(
        device=device, delta_ms_per_block=round_sig(sol.delta), delta_stderr_ms=_finite(se.get("delta")),
        eta_kv=round_sig(sol.eta), eta_kv_fitted=fit_eta, eta_kv_stderr=_finite(se.get("eta")),
        eta_memory=eta_m, eta_memory_fitted=sol.delta_clamped, eta_memory_stderr=_finite(se_eta_m),
        note="; ".join(notes), buckets=buckets, samples=sum(r.samples for r in rows),
        rms_error_pct_before=round_sig(_rms(before), 4), rms_error_pct_after=round_sig(_rms(after), 4),
        max_abs_error_pct_before=round_sig(max(abs(x) for x in before), 4),
        max_abs_error_pct_after=round_sig(worst, 4))
    return fit, sol, models


def _finite(x: float | None) -> float | None:
    return round_sig(x) if x is not None and math.isfinite(x) else None


def usable_rows(plan: Plan, report, min_samples: int = MIN_STAGE_SAMPLES, label: str = "the report") -> dict[int, list]:
    """Decode rows per stage that enter the fit; PlanError when a stage has too few steps."""
    out = {}
    for i, stage in enumerate(plan.partition.stages):
        decode = [r for r in report.rows if r.stage == i and r.phase == "decode"]
        rows = [r for r in decode if r.samples >= MIN_ROW_SAMPLES and r.measured_mean_ms > 0]
        steps = sum(r.samples for r in rows)
        if not rows or steps < min_samples:
            raise PlanError(
                f"too few samples in {label}: stage {i} ({stage.device}) has {sum(r.samples for r in decode)} decode "
                f"step(s) in {len(decode)} context bucket(s), {steps} of them in buckets with >= {MIN_ROW_SAMPLES} "
                f"steps; the fit needs >= {min_samples}: send more requests (several context lengths) and "
                "recalibrate again")
        out[i] = rows
    return out


def _key(row) -> tuple[int, str, int]:
    return row.stage, row.phase, row.context_min


def recalibrate(plan: Plan, report, source: str, min_samples: int = MIN_STAGE_SAMPLES,
                label: str = "the report") -> RecalibrationResult:
    """Check the report against the plan, fit every device, and build the next plan version."""
    check_report(plan, report, label)
    per_stage = usable_rows(plan, report, min_samples, label)
    devices: dict[str, list] = {}
    for i, rows in per_stage.items():
        devices.setdefault(plan.partition.stages[i].device, []).extend(rows)

    calibration = plan.calibration
    fits, solutions = [], {}
    for device, rows in devices.items():
        fit, sol, _ = fit_device(plan, device, rows)
        fits.append(fit)
        solutions[device] = (fit.eta_kv, fit.delta_ms_per_block, fit.eta_memory)
        calibration = _with(calibration, device, eta_kv=fit.eta_kv, delta_ms_per_block=fit.delta_ms_per_block,
                            eta_memory=fit.eta_memory)
    calibration = replace(calibration, provenance="recalibrated", samples=max(f.samples for f in fits))  # steps

    weights = {}
    for device, rows in devices.items():
        # final weights at the stored (rounded) values
        res = [(m.measured - m.predict_at(*solutions[device])) / m.measured for m in map(partial(_RowModel, plan), rows)]
        for r, w in zip(rows, _robust_weights(res, bisquare=True)):
            weights[_key(r)] = w

    table, residuals = [], []
    for row in report.rows:
        dev = calibration.for_device(row.device)
        after = _RowModel(plan, row).predict_at(*solutions.get(row.device, (dev.eta_kv, dev.delta_ms_per_block,
                                                                            dev.eta_memory)))
        if _key(row) in weights:
            w = weights[_key(row)]
            status = ("outlier: weight 0" if w == 0 else "fitted" if w >= 0.995 else f"fitted, weight {w:.2f}")
            residuals.append(FitResidual(
                stage=row.stage, device=row.device, context_min=row.context_min, context_max=row.context_max,
                samples=row.samples, context_mean=round_sig(row.context_mean), batch_mean=round_sig(row.batch_mean),
                measured_ms=round_sig(row.measured_mean_ms), predicted_before_ms=round_sig(row.predicted_ms),
                predicted_after_ms=round_sig(after),
                error_before_pct=round_sig(_pct(row.measured_mean_ms, row.predicted_ms), 4),
                error_after_pct=round_sig(_pct(row.measured_mean_ms, after), 4), weight=round_sig(w, 4)))
        elif row.phase == "decode":
            status = f"too few steps (< {MIN_ROW_SAMPLES})"
        else:
            status = "not fitted"
        table.append(TableRow(row.stage, row.device, row.phase, row.context_min, row.context_max, row.samples,
                              row.measured_mean_ms, row.predicted_ms, after, status))

    rp = report.plan
    created = datetime.fromtimestamp(report.created_unix_ns / 1e9, tz=timezone.utc)
    recalibration = Recalibration(
        method=METHOD, measured_at=created.isoformat(timespec="seconds").replace("+00:00", "Z"),
        machine=rp.machine, delta_from_other_machine=False, measured_plan_version=rp.version,
        measured_plan_digest=rp.digest, measured_split_k=rp.split_k,
        executor=MeasurementSource(source=source, architecture=report.architecture, kernel_isa=report.kernel_isa,
                                   steps=report.steps),
        devices=tuple(fits), residuals=tuple(residuals))
    new_plan = replan(plan, calibration, recalibration)
    return RecalibrationResult(plan, new_plan, tuple(fits), tuple(table), source)


# ---- for a person ------------------------------------------------------------------------------

def format_table(result: RecalibrationResult) -> str:
    old, new = result.parent, result.plan
    rec = new.recalibration
    lines = [f"recalibrated plan v{old.plan_version} {old.digest[:19]}… ({old.model.architecture} on "
             f"{old.machine.name}, split k={old.partition.split_k}) from {rec.executor.steps} steps measured by "
             f"{result.source} (kernels {rec.executor.kernel_isa}) at {rec.measured_at}"]
    lines.append("fit (robust least squares on relative error, decode rows):")
    for f in result.fits:
        was = old.calibration.for_device(f.device)
        pm = lambda se: f" ± {se:.2g}" if se is not None else ""  # noqa: E731
        eta = (f"η_kv {was.eta_kv:g} -> {f.eta_kv:.4g}{pm(f.eta_kv_stderr)}" if f.eta_kv_fitted
               else f"η_kv {f.eta_kv:g} (kept)")
        if f.eta_memory_fitted:
            eta += f", η_m {was.eta_memory:g} -> {f.eta_memory:.4g}{pm(f.eta_memory_stderr)}"
        lines.append(f"  {f.device:<4} δ {was.delta_ms_per_block:g} -> "
                     f"{f.delta_ms_per_block:.4g}{pm(f.delta_stderr_ms)} "
                     f"ms/block, {eta}; {f.buckets} buckets, {f.samples} steps; rms error "
                     f"{f.rms_error_pct_before:.1f}% -> {f.rms_error_pct_after:.1f}%, worst "
                     f"{f.max_abs_error_pct_before:.1f}% -> {f.max_abs_error_pct_after:.1f}%")
        if f.note:
            lines.append(f"       note: {f.note}")
    lines.append("measured vs predicted per stage and context bucket (before: the measured plan's model; "
                 f"after: the calibrated model, same steps, same split k={old.partition.split_k}):")
    lines.append(f"  {'stage':>5} {'device':<6} {'phase':<7} {'context':>15} {'steps':>6} {'measured':>10} "
                 f"{'before':>10} {'error':>8} {'after':>10} {'error':>8}  fit")
    for r in result.rows:
        lines.append(f"  {r.stage:>5} {r.device:<6} {r.phase:<7} {f'[{r.context_min}, {r.context_max})':>15} "
                     f"{r.samples:>6} {r.measured_ms:>10.4g} {r.before_ms:>10.4g} {r.error_before_pct:>+7.1f}% "
                     f"{r.after_ms:>10.4g} {r.error_after_pct:>+7.1f}%  {r.status}")
    k0, k1 = old.partition.split_k, new.partition.split_k
    move = f"k={k0} -> {k1}" if k0 != k1 else f"k={k1} (unchanged)"
    forced = " (forced by --split: kept)" if new.partition.forced else ""
    lines.append(f"search re-run with the calibrated model: split {move}{forced}, best feasible k="
                 f"{new.search.best_feasible_k}; predicted {old.prediction.ms_per_token:g} -> "
                 f"{new.prediction.ms_per_token:g} ms/token at context {new.prediction.context_tokens}, "
                 f"batch {new.prediction.batch_size}")
    return "\n".join(lines)
