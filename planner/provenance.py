"""Where a plan's calibration came from (DESIGN §8): the measurements, the fit, its residuals.

Part of the plan file (`plan.recalibration`), written by `helm-plan recalibrate` (planner.fit,
planner.calibrate) and carried by `--parent`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.serial import OMIT_IF_NONE


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
    # the GPU stage's part of prompt steps whose CPU stage streamed to the GPU (a row of their own
    # beside the bucket's other prompt steps: report.ReportRow.streamed); None: not
    streamed: bool | None = field(default=None, metadata=OMIT_IF_NONE)


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
