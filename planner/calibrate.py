"""Recalibration (DESIGN §8): fit the cost model's δ, η_kv (η_m), η_c and η_attn per device to
the executor's measured step times, and write the next version of the plan.

Input is the daemon's measurement report (schemas/report.schema.json), from a file or live over
gRPC: per stage, phase and power-of-two context bucket, the mean measured step time and what the
measured plan predicted for the same steps. Output is the plan's next version (plan_version + 1,
the parent's digest, the fitted calibration, a `recalibration` section with the provenance and
residuals of the fit, the refreshed prediction and the search re-run, which may move k).

Decode rows give δ and η_kv (or η_m, where δ would be negative); prefill rows (prompt chunks),
where there are enough, give η_c and η_attn with that δ. The model and the robust fit:
planner/fit.py.

    report = read_report("report.json")          # or fetch_report("127.0.0.1:50051", plan.digest)
    result = recalibrate(plan, report, "report report.json")
    result.plan                                   # the next version; format_table(result) for a person
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone

from planner.errors import PlanError
from planner.fit import (METHOD, RowModel, device_fit, fit_decode, fit_prefill, pct, residual, robust_weights,
                         with_values)
from planner.plan import Plan
from planner.planning import replan
from planner.provenance import DeviceFit, FitResidual, MeasurementSource, Recalibration
from planner.step_shape import streams
from planner.units import round_sig

MIN_STEP_MS = 1e-6            # a row whose steps took less (a nanosecond) measured nothing
MIN_ROW_SAMPLES = 5           # decode steps a report row needs to enter the fit
MIN_STAGE_SAMPLES = 20        # decode steps (in usable rows) every stage needs: fewer is "too few samples"
# A prompt chunk is a long step (tens of ms to seconds), so one is a measurement in itself: a
# daemon that saw each prompt length once still has its prefill fitted.
MIN_PREFILL_ROW_SAMPLES = 1   # prefill steps (prompt chunks) a report row needs to enter the prefill fit
MIN_PREFILL_STEPS = 2         # prefill steps a device needs before η_c is fitted (else kept, with a note)


# ---- the report: check ---------------------------------------------------------------------------

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
    # Each row is modelled from its means under the streaming policy that ran: a streamed row's
    # steps all reach its threshold and no other prompt step does, as the executor decides
    # (executor/streamed_prefill.py accepts); a row that says otherwise was not measured so.
    ran = _streamed_from(plan, report)
    seen = set()
    for row in report.rows:
        if _key(row) in seen:
            raise PlanError(f"{label} has two rows for stage {row.stage}'s {row.kind} steps in context "
                            f"[{row.context_min}, {row.context_max}); the report was edited")
        seen.add(_key(row))
        if row.streamed is None or row.phase != "prefill":
            if row.streamed:
                raise PlanError(f"{label}: stage {row.stage}'s decode row in context [{row.context_min}, "
                                f"{row.context_max}) says it streamed; only prompt steps stream")
            continue
        if row.streamed != streams(row.tokens_mean, ran):
            policy = f"prompt steps of >= {ran} tokens streamed" if ran else "nothing streamed"
            raise PlanError(f"{label}: stage {row.stage}'s prefill row in context [{row.context_min}, "
                            f"{row.context_max}) ({row.tokens_mean:g} tokens a step) says it "
                            f"{'streamed' if row.streamed else 'did not stream'}, but {policy}")


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
    streamed: bool = False           # streamed prompt steps (report.ReportRow.streamed)

    @property
    def kind(self) -> str:
        return "streamed" if self.streamed else self.phase

    @property
    def error_before_pct(self) -> float:
        return pct(self.measured_ms, self.before_ms)

    @property
    def error_after_pct(self) -> float:
        return pct(self.measured_ms, self.after_ms)


@dataclass(frozen=True)
class RecalibrationResult:
    parent: Plan
    plan: Plan                       # the next version
    fits: tuple[DeviceFit, ...]
    rows: tuple[TableRow, ...]       # every report row, in report order
    source: str


def usable_rows(plan: Plan, report, min_samples: int = MIN_STAGE_SAMPLES, label: str = "the report") -> dict[int, list]:
    """Decode rows per stage that enter the fit; PlanError when a stage has too few steps."""
    out = {}
    for i, stage in enumerate(plan.partition.stages):
        decode = [r for r in report.rows if r.stage == i and r.phase == "decode"]
        rows = [r for r in decode if r.samples >= MIN_ROW_SAMPLES and r.measured_mean_ms >= MIN_STEP_MS]
        steps = sum(r.samples for r in rows)
        if not rows or steps < min_samples:
            raise PlanError(
                f"too few samples in {label}: stage {i} ({stage.device}) has {sum(r.samples for r in decode)} decode "
                f"step(s) in {len(decode)} context bucket(s), {steps} of them in buckets with >= {MIN_ROW_SAMPLES} "
                f"steps; the fit needs >= {min_samples}: send more requests (several context lengths) and "
                "recalibrate again")
        out[i] = rows
    return out


def _prefill_rows(plan: Plan, report, device: str) -> tuple[list, str]:
    """A device's prefill rows that enter the prefill fit, or none and why. The CPU's prompt steps
    the measured load streamed to the GPU (`plan`: as it ran; steps of at least its
    stream_prefill_min_rows tokens on average) time the link and the GPU, not the CPU's η: left
    out of its fit, and said so. (The GPU stage's rows of those steps are its own prompt work, in
    the sub-steps it is priced for, and enter its fit.)"""
    rows = [r for r in report.rows if r.device == device and r.phase == "prefill"
            and r.samples >= MIN_PREFILL_ROW_SAMPLES and r.measured_mean_ms >= MIN_STEP_MS]
    streamed_from = plan.partition.stream_prefill_min_rows
    streamed = [r for r in rows if device == "cpu" and _streamed(r, streamed_from)]
    rows = [r for r in rows if r not in streamed]
    left_out = (f"{len(streamed)} prefill bucket(s) of >= {streamed_from} tokens a step left out: the measured load "
                "streamed them to the GPU, so they time the link and the GPU, not this CPU") if streamed else ""
    steps = sum(r.samples for r in rows)
    if steps >= MIN_PREFILL_STEPS:
        return rows, left_out
    return [], "; ".join(filter(None, (
        f"η_c and η_attn kept: {steps} prefill step(s) in buckets with >= {MIN_PREFILL_ROW_SAMPLES} steps, the "
        f"prefill fit needs >= {MIN_PREFILL_STEPS} (send prompts of several lengths)", left_out)))


def _streamed(row, streamed_from: int | None) -> bool:
    """Whether a report row's steps streamed the CPU stage to the GPU: as the row says, or (a report
    from before rows said) as its mean step size implies under the policy that ran, which misreads
    a bucket holding both kinds of step."""
    if row.streamed is not None:
        return row.streamed
    return row.phase == "prefill" and streams(row.tokens_mean, streamed_from)


def _streamed_from(plan: Plan, report) -> int | None:
    """The measured load's policy for its CPU stage's prompt steps: streamed from that many tokens,
    or None (a report from before it said ran the plan's)."""
    if report.stream_prefill_min_rows is None:
        return plan.partition.stream_prefill_min_rows
    return report.stream_prefill_min_rows or None


def _key(row) -> tuple[int, str, int, bool]:
    return row.stage, row.phase, row.context_min, bool(row.streamed)


def recalibrate(plan: Plan, report, source: str, min_samples: int = MIN_STAGE_SAMPLES,
                label: str = "the report") -> RecalibrationResult:
    """Check the report against the plan, fit every device, and build the next plan version."""
    check_report(plan, report, label)
    per_stage = usable_rows(plan, report, min_samples, label)
    devices: dict[str, list] = {}
    for i, rows in per_stage.items():
        devices.setdefault(plan.partition.stages[i].device, []).extend(rows)

    # The rows are modelled as the measured load ran: its CPU stage's prompt steps streamed from
    # the report's row count, or not at all (0: it may not have run the plan's policy; a report
    # that does not say ran as planned); the next plan version's search decides the policy afresh.
    ran = replace(plan, partition=replace(plan.partition, stream_prefill_min_rows=_streamed_from(plan, report)))
    calibration = plan.calibration
    fits, fitted_rows = [], []
    for device, rows in devices.items():
        decode = fit_decode(ran, device, rows)
        calibration = with_values(calibration, device, eta_kv=decode.shape, delta_ms_per_block=decode.delta,
                                  eta_memory=decode.level)
        prefill_rows, prefill_note = _prefill_rows(ran, report, device)
        prefill = fit_prefill(ran, prefill_rows, calibration) if prefill_rows else None
        if prefill is not None:
            calibration = with_values(calibration, device, eta_attn=prefill.shape, eta_compute=prefill.level)
        fits.append(device_fit(device, decode, prefill, prefill_note))
        fitted_rows += [m.row for f in (decode, prefill) if f is not None for m in f.models]
    calibration = replace(calibration, provenance="recalibrated", samples=max(f.samples for f in fits))  # steps

    # Every row against the written plan's model (the final calibration, stored values): the table,
    # and the robust weights of the fitted rows at those values.
    after = {}
    for row in report.rows:
        model = RowModel(ran, row, calibration=calibration)
        dev = calibration.for_device(row.device)
        after[_key(row)] = model.predict_at(getattr(dev, model.shape_name), dev.delta_ms_per_block,
                                            getattr(dev, model.level_name))
    weights = {}
    for device in devices:
        for phase in ("decode", "prefill"):
            group = [r for r in fitted_rows if r.device == device and r.phase == phase]
            res = [residual(r.measured_mean_ms, after[_key(r)]) for r in group]
            weights.update(zip(map(_key, group), robust_weights(res) if group else []))

    table, residuals = [], []
    for row in report.rows:
        after_ms = after[_key(row)]
        if _key(row) in weights:
            w = weights[_key(row)]
            status = ("outlier: weight 0" if w == 0 else "fitted" if w >= 0.995 else f"fitted, weight {w:.2f}")
            residuals.append(FitResidual(
                stage=row.stage, device=row.device, phase=row.phase, context_min=row.context_min,
                context_max=row.context_max, samples=row.samples, context_mean=round_sig(row.context_mean),
                batch_mean=round_sig(row.batch_mean), measured_ms=round_sig(row.measured_mean_ms),
                predicted_before_ms=round_sig(row.predicted_ms), predicted_after_ms=round_sig(after_ms),
                error_before_pct=round_sig(pct(row.measured_mean_ms, row.predicted_ms), 4),
                error_after_pct=round_sig(pct(row.measured_mean_ms, after_ms), 4), weight=round_sig(w, 4),
                streamed=True if row.streamed else None))
        elif row.phase == "decode":
            status = f"too few steps (< {MIN_ROW_SAMPLES})"
        elif row.device == "cpu" and _streamed(row, ran.partition.stream_prefill_min_rows):
            status = "not fitted (streamed: times the link and the GPU)"
        else:
            status = f"not fitted (fewer than {MIN_PREFILL_STEPS} prefill steps in all)"
        table.append(TableRow(row.stage, row.device, row.phase, row.context_min, row.context_max, row.samples,
                              row.measured_mean_ms, row.predicted_ms, after_ms, status, bool(row.streamed)))

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
    lines.append("fit (robust least squares on relative error; decode rows, then prefill rows):")
    for f in result.fits:
        was = old.calibration.for_device(f.device)
        pm = lambda se: f" ± {se:.2g}" if se is not None else ""  # noqa: E731
        eta = (f"η_kv {was.eta_kv:g} -> {f.eta_kv:.4g}{pm(f.eta_kv_stderr)}" if f.eta_kv_fitted
               else f"η_kv {f.eta_kv:g} (kept)")
        if f.eta_memory_fitted:
            eta += f", η_m {was.eta_memory:g} -> {f.eta_memory:.4g}{pm(f.eta_memory_stderr)}"
        pre = f.prefill
        if pre is not None:
            attn = (f"η_attn {was.eta_attn:g} -> {pre.eta_attn:.4g}{pm(pre.eta_attn_stderr)}" if pre.eta_attn_fitted
                    else f"η_attn {pre.eta_attn:g} (kept)")
            eta += (f"; prefill: η_c {was.eta_compute:g} -> {pre.eta_compute:.4g}{pm(pre.eta_compute_stderr)}, "
                    f"{attn}, {pre.buckets} buckets, {pre.samples} steps, rms error {pre.rms_error_pct_before:.1f}% "
                    f"-> {pre.rms_error_pct_after:.1f}%")
        lines.append(f"  {f.device:<4} δ {was.delta_ms_per_block:g} -> "
                     f"{f.delta_ms_per_block:.4g}{pm(f.delta_stderr_ms)} "
                     f"ms/block, {eta}; {f.buckets} buckets, {f.samples} steps; rms error "
                     f"{f.rms_error_pct_before:.1f}% -> {f.rms_error_pct_after:.1f}%, worst "
                     f"{f.max_abs_error_pct_before:.1f}% -> {f.max_abs_error_pct_after:.1f}%")
        if f.note:
            lines.append(f"       note: {f.note}")
        if pre is not None and pre.note:
            lines.append(f"       prefill note: {pre.note}")
    lines.append("measured vs predicted per stage and context bucket (before: the measured plan's model; "
                 f"after: the calibrated model, same steps, same split k={old.partition.split_k}):")
    lines.append(f"  {'stage':>5} {'device':<6} {'phase':<8} {'context':>15} {'steps':>6} {'measured':>10} "
                 f"{'before':>10} {'error':>8} {'after':>10} {'error':>8}  fit")
    for r in result.rows:
        lines.append(f"  {r.stage:>5} {r.device:<6} {r.kind:<8} {f'[{r.context_min}, {r.context_max})':>15} "
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
