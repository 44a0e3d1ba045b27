"""`helm-plan machine`: a machine profile from datasheets, for a machine you do not have.

    datasheet_machine(gpu="RTX 3090", cpu="EPYC 7H12", ram_bytes=parse_bytes("128GiB"))
    datasheet_machine(cpu="i7-13700H", ram_bytes=..., vram_bytes=..., hbm_gibps=..., gpu_gflops=..., pcie="4x16")

Peaks come from the catalogue (planner/datasheets.yaml, each entry with its source) or from
explicit figures, and DRAM and PCIe peaks from their arithmetic (channels x MT/s x 8 bytes;
lanes x transfer rate x line-code efficiency). Each rate of the profile is a peak times an
efficiency; both are recorded in its `datasheet` section, with every assumption that is on no
datasheet, so a reviewer sees what was assumed and `helm-plan profile` on the machine replaces
it with a measurement.
"""
from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path

import yaml

from planner.errors import PlanError
from planner.machine import (L3_OVER_DRAM, MACHINE_SCHEMA_VERSION, Calibration, CpuProfile, Datasheet, DatasheetRate,
                             GpuProfile, LinkProfile, MachineProfile, check_machine, l3_estimate, tool_version)
from planner.units import GIB, fmt_bytes, parse_bytes, parse_flops, parse_rate, round_sig

CATALOGUE = Path(__file__).with_name("datasheets.yaml")

# Efficiencies applied to datasheet peaks: what a sustained transfer or GEMM reaches of the peak.
# They are assumptions, recorded in every profile next to the peak they scale (override with
# --efficiency NAME=X); README "Machines you don't have" says what they rest on.
EFFICIENCY = {
    "dram": 0.6,          # multi-threaded reads of weight-shaped buffers vs channels x MT/s x 8 B
    "hbm": 0.85,          # device-to-device copy vs the memory bus's peak
    "link": 0.8,          # pinned host<->device copies vs the PCIe link's payload rate
    "gpu_compute": 0.5,   # prompt-chunk GEMMs vs dense tensor peak
    "cpu_compute": 0.5,   # fp32 GEMM on all cores vs the FMA units' peak at base clock
}
CUDA_CONTEXT_RESERVE = 1 << 30        # DESIGN §5: ≈1 GB of VRAM taken by the CUDA context
LINK_LATENCY_US = 10.0                # one small pinned copy: the order cudaMemcpy takes
RAM_LEFT_TO_OS = (2 << 30, 0.10)      # the OS and other processes keep max(2 GiB, 10%) of RAM

# PCIe payload rate per lane, GB/s: transfer rate x line code (8b/10b to gen 2, 128b/130b after) / 8
PCIE_LANE_GBPS = {1: 2.5 * 0.8 / 8, 2: 5.0 * 0.8 / 8, 3: 8.0 * 128 / 130 / 8, 4: 16.0 * 128 / 130 / 8,
                  5: 32.0 * 128 / 130 / 8}
_PCIE_RE = re.compile(r"^\s*(?:pcie\s*)?(?:gen\s*)?([1-5])(?:\.0)?\s*x\s*(1|2|4|8|16)\s*$", re.I)
# 64-bit DIMM channels; LPDDR's narrower channels: give their bandwidth as a rate
_DRAM_RE = re.compile(r"^\s*([0-9]+)\s*(?:ch|x|-channel)?[\s-]*(?:x\s*)?(DDR[3-5])-([0-9]{3,5})\s*$", re.I)


@functools.lru_cache(maxsize=1)
def catalogue() -> dict:
    return yaml.safe_load(CATALOGUE.read_text())


def _key(name: str) -> str:
    words = re.sub(r"[^a-z0-9]+", " ", str(name).lower()).split()
    return " ".join(w for w in words if w not in ("nvidia", "geforce", "amd", "intel", "core", "gen", "13th"))


def find(kind: str, name: str) -> dict:
    """The catalogue entry of a GPU or CPU by its name or an alias, case and vendor words aside."""
    entries = catalogue()[kind]
    want = _key(name)
    for e in entries:
        if want in [_key(n) for n in (e["name"], *e.get("aliases", ()))]:
            return e
    spellings = {_key(n): e["name"] for e in entries for n in (e["name"], *e.get("aliases", ()))}
    close = list(dict.fromkeys(spellings[k] for k in difflib.get_close_matches(want, spellings, n=5, cutoff=0.6)))[:3]
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise PlanError(f"--{kind[:-1]} {name!r} is not in the catalogue{hint} (helm-plan machine --list shows it; or "
                    f"give the figures: {_EXPLICIT[kind]})")


_EXPLICIT = {"gpus": "--vram, --hbm, --gpu-tflops and --pcie", "cpus": "--cores and --dram"}


def pcie_peak_gibps(spec: str) -> tuple[float, str]:
    """A PCIe link's payload peak: '4x16' (generation 4, 16 lanes) or a rate ('25GB/s')."""
    m = _PCIE_RE.match(spec)
    if m:
        gen, lanes = int(m.group(1)), int(m.group(2))
        gbps = PCIE_LANE_GBPS[gen] * lanes
        return gbps * 1e9 / GIB, f"PCIe {gen}.0 x{lanes}: {lanes} lanes x {PCIE_LANE_GBPS[gen]:.4g} GB/s = {gbps:.4g} GB/s"
    try:
        return parse_rate(spec, "--pcie"), f"entered: {spec}"
    except PlanError:
        raise PlanError(f"--pcie {spec!r}: give a generation and lanes (4x16, gen5x16) or a bandwidth (25GB/s)") from None


def dram_peak_gibps(spec: str) -> tuple[float, str]:
    """DRAM peak read bandwidth: '2ch-DDR5-5200' (channels x MT/s x 8 bytes) or a rate ('83.2GB/s')."""
    m = _DRAM_RE.match(spec)
    if m:
        channels, kind, mts = int(m.group(1)), m.group(2).upper(), int(m.group(3))
        gbps = channels * mts * 8 / 1e3
        return gbps * 1e9 / GIB, f"{channels} channels x {kind}-{mts} x 8 B = {gbps:.4g} GB/s"
    try:
        return parse_rate(spec, "--dram"), f"entered: {spec}"
    except PlanError:
        raise PlanError(f"--dram {spec!r}: give channels of DIMMs (2ch-DDR5-5200, 8xDDR4-3200) or a bandwidth "
                        "(83.2GB/s; for LPDDR, its bandwidth)") from None


def _efficiencies(overrides: dict[str, float] | None) -> dict[str, float]:
    eff = dict(EFFICIENCY)
    for k, v in (overrides or {}).items():
        if k not in eff:
            raise PlanError(f"--efficiency {k}: unknown (one of {', '.join(EFFICIENCY)})")
        if not 0 < v <= 1:
            raise PlanError(f"--efficiency {k}={v}: must be in (0, 1]")
        eff[k] = v
    return eff


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", _key(text)).strip("-")


def datasheet_machine(*, ram_bytes: int, gpu: str | None = None, cpu: str | None = None,
                      ram_available_bytes: int | None = None, vram_bytes: int | None = None,
                      hbm_gibps: float | None = None, gpu_gflops: float | None = None, pcie: str | None = None,
                      dram: str | None = None, cores: int | None = None, threads: int | None = None,
                      l3_bytes: int | None = None, cpu_gflops: float | None = None, isa: tuple[str, ...] | None = None,
                      efficiency: dict[str, float] | None = None, cuda_reserve_bytes: int = CUDA_CONTEXT_RESERVE,
                      link_latency_us: float = LINK_LATENCY_US, name: str | None = None) -> MachineProfile:
    """The profile of a machine built from datasheet parts: explicit figures override the
    catalogue's. PlanError names what is missing or unknown."""
    eff = _efficiencies(efficiency)
    rates, assumptions, sources = [], [], []

    def rate(field: str, peak: float, key: str, basis: str) -> float:
        rates.append(DatasheetRate(field=field, peak=round_sig(peak), efficiency=eff[key], basis=basis))
        return round_sig(round_sig(peak) * eff[key])

    # ---- CPU and RAM
    c = find("cpus", cpu) if cpu else None
    if c is None and (cores is None or dram is None):
        raise PlanError("the CPU: give --cpu NAME from the catalogue (--list), or --cores and --dram")
    if c:
        sources.append(f"{c['name']}: {c['source']}")
    cores = cores or c["cores"]
    threads = threads or (c["threads"] if c and c["cores"] == cores else cores)
    if threads < cores:
        raise PlanError(f"--threads {threads} is fewer than the {cores} cores")
    dram_peak, dram_basis = dram_peak_gibps(dram) if dram else dram_peak_gibps(
        f"{c['memory']['channels']}ch-{c['memory']['type']}-{c['memory']['mts']}")
    dram_gibps = rate("cpu.dram_read_gibps", dram_peak, "dram", dram_basis)
    if cpu_gflops is not None:
        cpu_basis, cpu_peak = "entered: --cpu-gflops", cpu_gflops
    elif c:
        cpu_peak = sum(s["cores"] * s["flops_per_cycle"] * s["ghz"] for s in c["simd"])
        cpu_basis = " + ".join(f"{s['cores']} cores x {s['flops_per_cycle']} FLOP/cycle x {s['ghz']} GHz"
                               for s in c["simd"]) + " (fp32 FMA at base clock)"
        if cores != c["cores"]:     # --cores: that many of its cores at their mean rate
            cpu_peak *= cores / c["cores"]
            cpu_basis = f"{cores} of {c['cores']} cores: ({cpu_basis}) x {cores}/{c['cores']}"
    else:
        cpu_peak = cores * 32 * 2.5
        cpu_basis = f"{cores} cores x 32 FLOP/cycle (2 x 256-bit FMA) x 2.5 GHz: assumed, no --cpu-gflops"
        assumptions.append(f"CPU peak assumed: {cpu_basis}")
    compute = rate("cpu.compute_gflops", cpu_peak, "cpu_compute", cpu_basis)
    if ram_available_bytes is None:
        keep = max(RAM_LEFT_TO_OS[0], int(RAM_LEFT_TO_OS[1] * ram_bytes))
        if keep >= ram_bytes:
            raise PlanError(f"--ram {fmt_bytes(ram_bytes)} leaves nothing once the OS keeps {fmt_bytes(keep)}: "
                            "give --ram-available")
        ram_available_bytes = ram_bytes - keep
        assumptions.append(f"RAM available: {fmt_bytes(ram_available_bytes)} of {fmt_bytes(ram_bytes)} (the OS and "
                           f"other processes keep max(2 GiB, 10%); --ram-available sets it)")
    elif ram_available_bytes > ram_bytes:
        raise PlanError(f"--ram-available {fmt_bytes(ram_available_bytes)} is more than --ram {fmt_bytes(ram_bytes)}")
    l3 = l3_bytes if l3_bytes is not None else (parse_bytes(c["l3"]) if c else 0)
    assumptions.append(f"L3 read bandwidth: {L3_OVER_DRAM:g} x DRAM (DESIGN §4), not on a datasheet")
    cpu_profile = CpuProfile(
        model_name=c["name"] if c else (cpu or "entered CPU"), cores=cores, threads=threads,
        isa=tuple(isa if isa is not None else (c["isa"] if c else ())), l3_bytes=l3, dram_read_gibps=dram_gibps,
        dram_read_gibps_runs=(), dram_buffer_bytes=0, l3_read_gibps=l3_estimate(dram_gibps),
        l3_read_source=f"estimated: {L3_OVER_DRAM:g} x dram", compute_gflops=compute, ram_total_bytes=ram_bytes,
        ram_available_bytes=ram_available_bytes)

    # ---- GPU and link
    gpu_profile = link = None
    g = None
    explicit_gpu = any(x is not None for x in (vram_bytes, hbm_gibps, gpu_gflops))
    if gpu or explicit_gpu:
        if gpu and not (vram_bytes and hbm_gibps and gpu_gflops and pcie):
            g = find("gpus", gpu)
            sources.append(f"{g['name']}: {g['source']}")
        elif not gpu:
            missing = [f for f, v in (("--vram", vram_bytes), ("--hbm", hbm_gibps), ("--gpu-tflops", gpu_gflops),
                                      ("--pcie", pcie)) if v is None]
            if missing:
                raise PlanError(f"a GPU without --gpu NAME needs {', '.join(missing)}")
        vram = vram_bytes or parse_bytes(g["vram"])
        if cuda_reserve_bytes >= vram:
            raise PlanError(f"--cuda-reserve {fmt_bytes(cuda_reserve_bytes)} leaves nothing of {fmt_bytes(vram)} VRAM")
        assumptions.append(f"CUDA context and driver: {fmt_bytes(cuda_reserve_bytes)} of VRAM (--cuda-reserve)")
        hbm = rate("gpu.hbm_gibps", hbm_gibps or parse_rate(g["memory"]), "hbm",
                   "entered: --hbm" if hbm_gibps else f"{g['name']}: {g['memory']}")
        tensor = rate("gpu.prefill_gflops", gpu_gflops or parse_flops(g["fp16_tensor"]), "gpu_compute",
                      "entered: --gpu-tflops" if gpu_gflops else
                      f"{g['name']}: {g['fp16_tensor']} dense FP16/BF16 tensor, FP32 accumulate")
        gpu_profile = GpuProfile(
            name=g["name"] if g else gpu or "entered GPU", vram_total_bytes=vram,
            vram_usable_bytes=vram - cuda_reserve_bytes, cuda_context_reserve_bytes=cuda_reserve_bytes,
            hbm_gibps=hbm, hbm_gibps_runs=(), prefill_gflops=tensor,
            prefill_matmul="datasheet: dense FP16/BF16 tensor peak x efficiency (not measured)",
            flash_attention=g.get("flash_attention", True) if g else None)
        if g is not None:
            assumptions.append(f"flash attention: {'runs' if gpu_profile.flash_attention else 'does not run'} on "
                               f"the {g['name']} (catalogue: Ampere or newer)")
        link_peak, link_basis = pcie_peak_gibps(pcie or f"{g['pcie']['gen']}x{g['pcie']['lanes']}")
        h2d = rate("link.h2d_gibps", link_peak, "link", link_basis)
        d2h = rate("link.d2h_gibps", link_peak, "link", link_basis)
        assumptions.append(f"link latency: {link_latency_us:g} us per copy (--link-latency)")
        link = LinkProfile(h2d_gibps=h2d, d2h_gibps=d2h, h2d_latency_us=link_latency_us,
                           d2h_latency_us=link_latency_us, pinned=True)

    if gpu_profile is None and pcie is not None:
        raise PlanError("--pcie is the GPU's host link: give a GPU (--gpu, or --vram, --hbm and --gpu-tflops)")
    gpu_name = (g["name"] if g else gpu or "entered GPU") if gpu_profile else None
    name = name or "-".join(_slug(x) for x in (gpu_name, cpu_profile.model_name) if x) or "datasheet-machine"
    parts = " + ".join(x for x in (gpu_name, cpu_profile.model_name, f"{fmt_bytes(ram_bytes)} RAM") if x)
    machine = MachineProfile(
        kind="machine_profile", schema_version=MACHINE_SCHEMA_VERSION, name=name, source="datasheet",
        notes=(f"Written by helm-plan machine from datasheets ({parts}), not measured: each rate is a datasheet "
               "peak x an efficiency (see `datasheet`). Run helm-plan profile on the machine to replace them."),
        tool_version=tool_version(), measured_at=None, profile_seconds=None, quick=False,
        cpu=cpu_profile, gpu=gpu_profile, link=link, calibration=Calibration(),
        datasheet=Datasheet(gpu=(g["name"] if g else "entered") if gpu_profile else None,
                            cpu=c["name"] if c else "entered", rates=tuple(rates),
                            assumptions=tuple(assumptions), sources=tuple(sources)))
    check_machine(machine, "datasheet profile")
    return machine


def format_catalogue() -> str:
    cat = catalogue()
    lines = [f"{'GPU':<30} {'VRAM':>7} {'memory':>10} {'PCIe':>8} {'FP16 tensor':>12}"]
    for g in cat["gpus"]:
        lines.append(f"{g['name']:<30} {g['vram']:>7} {g['memory']:>10} {'%d.0 x%d' % (g['pcie']['gen'], g['pcie']['lanes']):>8} "
                     f"{g['fp16_tensor']:>12}")
    lines += ["", f"{'CPU':<34} {'cores':>5} {'L3':>7} {'memory':>16}"]
    for c in cat["cpus"]:
        mem = c["memory"]
        lines.append(f"{c['name']:<34} {c['cores']:>5} {c['l3']:>7} {'%dch %s-%d' % (mem['channels'], mem['type'], mem['mts']):>16}")
    lines += ["", f"sources: {CATALOGUE.name}; efficiencies applied to these peaks: "
                  + ", ".join(f"{k} {v:g}" for k, v in EFFICIENCY.items())]
    return "\n".join(lines)
