"""Machine profile: what the cost model needs to know about a machine (DESIGN §4).

Measured by `helm-plan profile` (planner/profile.py), written from datasheets by `helm-plan
machine` (planner/datasheet.py) or entered by hand, saved as YAML validated by
schemas/machine.schema.json, embedded in every plan so a plan is self-contained and two plans
made on different machines can be diffed. Stored bandwidths are GiB/s (2^30 bytes per second,
suffix `_gibps`), FLOP rates GFLOP/s (10^9, suffix `_gflops`), sizes bytes (`_bytes`); a profile
file may write any of them with a unit ("936 GB/s", "24GiB", "82.6 TFLOPS"), and may leave out
what only a measurement records (runs, buffer sizes, timings): `complete_profile` fills both in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from planner import __version__
from planner.errors import PlanError
from planner.schema import validate
from planner.serial import OMIT_IF_NONE, from_dict, to_dict
from planner.units import parse_bytes, parse_flops, parse_rate, round_sig
from planner.yamlio import dump_yaml, read_yaml

MACHINE_SCHEMA_VERSION = 1
L3_OVER_DRAM = 3.0                       # B_L3 ≈ 3·M where the L3 was not measured (DESIGN §4)


def l3_estimate(dram_gibps: float) -> float:
    """B_L3 where it was not measured: L3_OVER_DRAM x the DRAM read bandwidth."""
    return round_sig(L3_OVER_DRAM * dram_gibps, 4)


@dataclass(frozen=True)
class PromptRate:
    rows: int                            # tokens in the prompt chunk
    gflops: float


@dataclass(frozen=True)
class KernelRates:
    """What the executor's CPU kernels achieve for one weight dtype (executor/probe.py)."""
    dtype: str                           # float32 | bfloat16 | float16
    gemv_gibps: float                    # decode: our GEMV streaming cold weights of this dtype
    gemm_path: str                       # prompt chunks: the fastest path (gemv | gemm | torch | torch_fp32)
    gemm_min_rows: int                   # the batch from which that path beats the GEMV tiles
    gemm_gflops: float                   # its rate on a prompt chunk (256 rows x a 2048 x 2048 weight)
    gemm_candidates: dict[str, float]    # every path's rate on that chunk, GFLOP/s
    prompt_gflops: tuple[PromptRate, ...]  # a prompt chunk through a decoder block, per projection
                                         # FLOP (element-wise work included), at a few chunk sizes
    attention_gflops: float              # prompt attention (fused SDPA) over a KV cache of this dtype
    attention_kernel_max_queries: int    # the longest chunk of queries our attention kernel beats it on

    def prompt_gflops_at(self, rows: float) -> float:
        """The block rate at a chunk of `rows` tokens: linear in log(rows) between the measured
        sizes, the nearest one outside them; below gemm_min_rows, where the GEMV tiles take the
        chunk, their measured rate."""
        if rows < self.gemm_min_rows and "gemv" in self.gemm_candidates:
            return self.gemm_candidates["gemv"]
        points = sorted((p.rows, p.gflops) for p in self.prompt_gflops)
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, g0), (r1, g1) in zip(points, points[1:]):
            if rows <= r1:
                f = math.log(rows / r0) / math.log(r1 / r0)
                return g0 + f * (g1 - g0)
        return points[-1][1]


@dataclass(frozen=True)
class CpuKernels:
    """The CPU stage's kernels as measured on this machine: the rates the cost model prices
    and the prompt-GEMM routes the executor takes (the choice is this machine's, not a constant)."""
    isa: str                             # kernel variant measured (avx512bf16 | avx512 | avx2 | portable)
    threads: int
    fma_peak_gflops: float               # fp32 FMA peak of those threads, registers only
    dtypes: tuple[KernelRates, ...]

    def for_dtype(self, dtype: str | None) -> KernelRates | None:
        return next((r for r in self.dtypes if r.dtype == dtype), None)


@dataclass(frozen=True)
class CpuProfile:
    model_name: str                      # /proc/cpuinfo "model name"
    cores: int                           # physical cores this process may use (threads for CPU stage)
    threads: int                         # logical CPUs this process may use
    isa: tuple[str, ...]                 # SIMD features our kernels dispatch on (avx2, f16c, avx512f, ...)
    l3_bytes: int                        # C_L3: last-level cache size (0 when unknown)
    dram_read_gibps: float               # M: sustained multi-threaded read bandwidth, median of runs
    dram_read_gibps_runs: tuple[float, ...]  # every run, for the spread (empty when entered by hand)
    dram_buffer_bytes: int               # buffer the bandwidth was measured over (far larger than L3)
    l3_read_gibps: float                 # B_L3: read bandwidth of a buffer that fits in L3
    l3_read_source: str                  # "measured" | "estimated: 3 x dram" | "manual"
    compute_gflops: float                # P_dec on the CPU: fp32 GEMM throughput, all cores
    ram_total_bytes: int                 # MemTotal
    ram_available_bytes: int             # MemAvailable when profiled: the host memory budget
    # The executor's kernels as measured (None: entered by hand or profiled before they were; the
    # cost model then uses the DRAM and fp32 GEMM figures above).
    kernels: CpuKernels | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class GpuProfile:
    name: str                            # torch.cuda.get_device_name
    vram_total_bytes: int
    vram_usable_bytes: int               # free VRAM once the CUDA context exists
    cuda_context_reserve_bytes: int      # total - usable (context, driver, other processes)
    hbm_gibps: float                     # device-to-device copy: (read + written bytes) / time
    hbm_gibps_runs: tuple[float, ...]
    prefill_gflops: float                # (512, H) x (H, H) half-precision matmul
    prefill_matmul: str                  # the shape and dtype it was measured with
    # What a stream's first GEMM allocates and keeps (cuBLAS's workspace for it): usable VRAM is
    # read after the probes' stream has one; the executor keeps one more (None: not measured)
    stream_workspace_bytes: int | None = field(default=None, metadata=OMIT_IF_NONE)
    # Whether PyTorch's flash attention runs half-precision GQA here: the GPU stage's prompt chunks
    # then take it, with no mask (executor/attention.py), else they stream (None: not known, priced so)
    flash_attention: bool | None = field(default=None, metadata=OMIT_IF_NONE)
    # GiB/s at which the GPU stage's projections stream their weights (a one-token matmul in half
    # precision; the copy's hbm_gibps overstates it): weight reads are priced with it, KV reads with
    # hbm_gibps (None: both with hbm_gibps)
    gemv_gibps: float | None = field(default=None, metadata=OMIT_IF_NONE)
    # What one decoder block adds to the GPU stage's decode step, timed through the executor's own
    # step (executor/device_probe.py: CUDA graphs and all), and the block's roofline at the rates
    # above: the excess is the profile's δ for the GPU (calibration.cuda). decode_block: which
    # block, and how its step ran
    decode_block_ms: float | None = field(default=None, metadata=OMIT_IF_NONE)
    decode_block_roofline_ms: float | None = field(default=None, metadata=OMIT_IF_NONE)
    decode_block: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class LinkProfile:
    h2d_gibps: float                     # host -> device, pinned host memory
    d2h_gibps: float                     # device -> host, pinned host memory
    h2d_latency_us: float                # one small pinned copy, host -> device
    d2h_latency_us: float                # one small pinned copy, device -> host
    pinned: bool                         # measured with page-locked host memory


@dataclass(frozen=True)
class DeviceCalibration:
    eta_compute: float = 1.0             # η_c: achieved / measured FLOP rate
    eta_memory: float = 1.0              # η_m: achieved / measured bandwidth
    delta_ms_per_block: float = 0.0      # δ: fixed overhead per transformer block per step
    eta_kv: float = 1.0                  # η_kv: KV reads' efficiency on top of η_m (attention kernels
                                         # stream KV slower than GEMVs stream weights); recalibration fits it
    eta_attn: float = 1.0                # η_attn: prompt attention's FLOP rate on top of η_c (a fused
                                         # attention kernel and the projections' GEMMs run at different rates)


@dataclass(frozen=True)
class Calibration:
    cpu: DeviceCalibration = field(default_factory=DeviceCalibration)
    cuda: DeviceCalibration = field(default_factory=DeviceCalibration)
    provenance: str = "default"          # "default" | "manual" | "profiled" (CPU η_kv, GPU δ probed) | "recalibrated"
    samples: int = 0                     # executor measurements the values were fitted to

    def for_device(self, device: str) -> DeviceCalibration:
        return self.cpu if device == "cpu" else self.cuda


@dataclass(frozen=True)
class DatasheetRate:
    """One rate of a datasheet profile: a published (or computed) peak times an explicit
    efficiency. `helm-plan profile` on the machine replaces the estimate with a measurement, and
    recalibration's η then corrects what remains."""
    field: str                           # the profile field it sets, e.g. "gpu.hbm_gibps"
    peak: float                          # in that field's unit (GiB/s, GFLOP/s)
    efficiency: float                    # field = peak × efficiency
    basis: str                           # where the peak comes from: the datasheet figure or the arithmetic


@dataclass(frozen=True)
class Datasheet:
    """How a `source: datasheet` profile was made (planner/datasheet.py)."""
    gpu: str | None                      # catalogue entry ("GeForce RTX 3090"), "entered", or None
    cpu: str | None
    rates: tuple[DatasheetRate, ...]
    assumptions: tuple[str, ...]         # what was not on any datasheet (RAM left to the OS, CUDA context, ...)
    sources: tuple[str, ...]             # the documents the figures come from


@dataclass(frozen=True)
class MachineProfile:
    kind: str                            # always "machine_profile"
    schema_version: int
    name: str                            # short identifier, e.g. "laptop-rtx4060-i7-13700h"
    source: str                          # "measured" | "datasheet" | "manual" | "placeholder"
    notes: str
    tool_version: str
    measured_at: str | None              # ISO time of measurement (informational)
    profile_seconds: float | None        # how long the measurement took
    quick: bool                          # measured with --quick (fewer, smaller runs)
    cpu: CpuProfile
    gpu: GpuProfile | None               # None: no CUDA device
    link: LinkProfile | None             # None: no CUDA device
    calibration: Calibration             # defaults for plans made for this machine
    datasheet: Datasheet | None = field(default=None, metadata=OMIT_IF_NONE, kw_only=True)

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.link is not None


def machine_from_dict(data: dict, what: str = "machine profile") -> MachineProfile:
    data = complete_profile(data, what)
    validate(data, "machine", what)
    machine = from_dict(MachineProfile, data)
    check_machine(machine, what)
    return machine


_UNIT_PARSERS = {"_bytes": parse_bytes, "_gibps": parse_rate, "_gflops": parse_flops}


def _canonical_units(section: dict, where: str, what: str) -> dict:
    """`section` with every quantity written with a unit ("24GiB", "936 GB/s") in its field's
    canonical unit; PlanError naming the field when one cannot be read."""
    out = dict(section)
    for key, value in section.items():
        suffix = next((s for s in _UNIT_PARSERS if key.endswith(s) or key.endswith(s + "_runs")), None)
        if suffix is None:
            continue
        parse = _UNIT_PARSERS[suffix]
        try:
            if isinstance(value, str):
                out[key] = _stored(parse(value, ""))
            elif isinstance(value, list) and key.endswith("_runs"):
                out[key] = [_stored(parse(v, "")) if isinstance(v, str) else v for v in value]
        except PlanError as e:
            raise PlanError(f"{what}: field '{where}{key}'{e}") from None
    return out


def _stored(value: int | float) -> int | float:
    return value if isinstance(value, int) else round_sig(value)


def complete_profile(data: dict, what: str = "machine profile") -> dict:
    """A hand-written profile in the schema's complete form: quantities written with units in
    the canonical unit, and what only a measurement records (runs, buffer sizes, timings, the
    tool version, a default calibration) filled in, so a person writes the figures the cost
    model reads and nothing else. A complete profile comes back unchanged."""

    if not isinstance(data, dict):
        return data
    out = {"kind": "machine_profile", "schema_version": MACHINE_SCHEMA_VERSION, **data}
    out.setdefault("source", "manual")
    out.setdefault("notes", "")
    out.setdefault("tool_version", tool_version())
    for key, default in (("measured_at", None), ("profile_seconds", None), ("quick", False), ("gpu", None),
                         ("link", None)):
        out.setdefault(key, default)
    out.setdefault("calibration", to_dict(Calibration()))
    if isinstance(out.get("cpu"), dict):
        cpu = _canonical_units(out["cpu"], "cpu.", what)
        cpu.setdefault("threads", cpu.get("cores"))
        cpu.setdefault("isa", [])
        cpu.setdefault("l3_bytes", 0)
        cpu.setdefault("dram_read_gibps_runs", [])
        cpu.setdefault("dram_buffer_bytes", 0)
        dram = cpu.get("dram_read_gibps")
        if "l3_read_gibps" not in cpu and isinstance(dram, (int, float)):
            if not 0 < dram < 1e9:   # the L3 estimate below is derived from it
                raise PlanError(f"{what}: field 'cpu.dram_read_gibps': must be a positive, finite rate, got {dram}")
            cpu["l3_read_gibps"] = l3_estimate(dram)
            cpu.setdefault("l3_read_source", f"estimated: {L3_OVER_DRAM:g} x dram")
        cpu.setdefault("l3_read_source", "manual")
        out["cpu"] = cpu
    if isinstance(out.get("gpu"), dict):
        gpu = _canonical_units(out["gpu"], "gpu.", what)
        total, usable, reserve = (gpu.get(k) for k in ("vram_total_bytes", "vram_usable_bytes",
                                                       "cuda_context_reserve_bytes"))
        if isinstance(total, int) and usable is None and isinstance(reserve, int):
            gpu["vram_usable_bytes"] = total - reserve
        elif isinstance(total, int) and isinstance(usable, int) and reserve is None:
            gpu["cuda_context_reserve_bytes"] = total - usable
        gpu.setdefault("hbm_gibps_runs", [])
        gpu.setdefault("prefill_matmul", "entered by hand")
        out["gpu"] = gpu
    if isinstance(out.get("link"), dict):
        link = _canonical_units(out["link"], "link.", what)
        if "d2h_gibps" not in link and "h2d_gibps" in link:
            link["d2h_gibps"] = link["h2d_gibps"]
        link.setdefault("pinned", True)
        out["link"] = link
    return out


def check_machine(m: MachineProfile, what: str = "machine profile", prefix: str = "") -> None:
    """Cross-field rules a JSON Schema cannot say: a profile that contradicts itself is refused,
    naming the field (a 93 GiB usable VRAM on a 24 GiB card once planned a 32B model onto it)."""
    def bad(field: str, msg: str):
        raise PlanError(f"{what}: inconsistent profile at field '{prefix}{field}': {msg}")

    gib = 2**30
    for name, value in _numbers(to_dict(m)):
        if isinstance(value, float) and not math.isfinite(value):
            bad(name, f"must be a finite number, got {value}")
    if m.link is not None and (m.link.h2d_latency_us < 0 or m.link.d2h_latency_us < 0):
        bad("link.h2d_latency_us", "latencies must be >= 0")
    c = m.cpu
    positive = [("cpu.dram_read_gibps", c.dram_read_gibps), ("cpu.l3_read_gibps", c.l3_read_gibps),
                ("cpu.compute_gflops", c.compute_gflops)]
    if m.gpu is not None:
        positive += [("gpu.hbm_gibps", m.gpu.hbm_gibps), ("gpu.prefill_gflops", m.gpu.prefill_gflops),
                     ("gpu.vram_total_bytes", m.gpu.vram_total_bytes), ("gpu.vram_usable_bytes", m.gpu.vram_usable_bytes)]
    if m.link is not None:
        positive += [("link.h2d_gibps", m.link.h2d_gibps), ("link.d2h_gibps", m.link.d2h_gibps)]
    for name, value in positive:
        if not value > 0:
            bad(name, f"must be > 0, got {value}")
    if c.threads < c.cores:
        bad("cpu.threads", f"{c.threads} logical CPUs is fewer than the {c.cores} cores")
    if c.ram_available_bytes > c.ram_total_bytes:
        bad("cpu.ram_available_bytes", f"{c.ram_available_bytes / gib:.1f} GiB available is more than the "
                                       f"{c.ram_total_bytes / gib:.1f} GiB total")
    if (m.gpu is None) != (m.link is None):
        bad("link" if m.link is None else "gpu", "a GPU profile and a link profile go together (both, or neither)")
    g = m.gpu
    if g is not None:
        if g.vram_usable_bytes > g.vram_total_bytes:
            bad("gpu.vram_usable_bytes", f"{g.vram_usable_bytes / gib:.1f} GiB usable is more than the "
                                         f"{g.vram_total_bytes / gib:.1f} GiB total")
        if g.cuda_context_reserve_bytes != g.vram_total_bytes - g.vram_usable_bytes:
            bad("gpu.cuda_context_reserve_bytes", f"{g.cuda_context_reserve_bytes} is not total - usable = "
                                                  f"{g.vram_total_bytes - g.vram_usable_bytes}")
    if (m.source == "datasheet") != (m.datasheet is not None):
        bad("datasheet", "a profile has a datasheet section exactly when its source is 'datasheet'")
    for i, r in enumerate(m.datasheet.rates if m.datasheet else ()):
        value = _field_value(m, r.field)
        if value is None:
            bad(f"datasheet.rates[{i}].field", f"{r.field!r} is not a rate of this profile")
        if not 0 < r.efficiency <= 1:
            bad(f"datasheet.rates[{i}].efficiency", f"must be in (0, 1], got {r.efficiency}")
        if not math.isclose(value, r.peak * r.efficiency, rel_tol=1e-4):
            bad(r.field, f"{value:g} is not the datasheet's peak {r.peak:g} x efficiency {r.efficiency:g} = "
                         f"{r.peak * r.efficiency:g} (remake the profile with helm-plan machine, --efficiency "
                         "NAME=X for another efficiency; or measure the machine with helm-plan profile)")


def _numbers(data, path: str = ""):
    """(field path, value) of every number in a profile's plain data."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _numbers(v, f"{path}.{k}" if path else k)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield path, data


def is_machine_profile(data) -> bool:
    """Whether parsed YAML is meant as a machine profile: kind machine_profile, or a hand-written
    shorthand without a kind that has a cpu section."""
    return isinstance(data, dict) and data.get("kind", "machine_profile" if "cpu" in data else None) == \
        "machine_profile"


def _field_value(m: MachineProfile, path: str) -> float | None:
    section, _, name = path.partition(".")
    obj = getattr(m, section, None) if section in ("cpu", "gpu", "link") else None
    value = getattr(obj, name, None) if obj is not None and name.endswith(("_gibps", "_gflops")) else None
    return value if isinstance(value, (int, float)) else None


def load_machine(path_or_text: str | Path) -> MachineProfile:
    """Read and validate a machine profile (a path or YAML text); PlanError when bad."""

    data, what = read_yaml(path_or_text, "machine profile")
    if not isinstance(data, dict):
        raise PlanError(f"{what}: expected a YAML mapping")
    return machine_from_dict(data, what)


def machine_to_yaml(machine: MachineProfile) -> str:
    header = [f"HELM machine profile: {machine.name} ({machine.source})"]
    if machine.notes:
        header.append(machine.notes)
    return dump_yaml(to_dict(machine), header)


def save_machine(machine: MachineProfile, path: str | Path) -> None:
    validate(to_dict(machine), "machine", "machine profile")
    Path(path).write_text(machine_to_yaml(machine))


def tool_version() -> str:
    return __version__
