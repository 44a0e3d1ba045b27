"""helm-plan's command line: the parser of every command (planner.cli runs them). Flags that take
sizes, rates and FLOP rates read units (planner.units); bad values are argparse usage errors."""
from __future__ import annotations

import argparse
import math

from planner.daemon_client import add_credential_flags
from planner.errors import PlanError
from planner.plan import DEFAULT_PAGE_SIZE_TOKENS, DEFAULT_WATERMARK
from planner.units import parse_bytes, parse_flops, parse_rate


def _int_arg(name: str, minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value
    return parse


def _unit_arg(name: str, parse):
    """An argparse type reading a value with units (planner.units' parse_bytes, parse_rate, parse_flops)."""
    def convert(text: str):
        try:
            return parse(text, name)
        except PlanError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def _efficiency_arg(text: str) -> tuple[str, float]:
    key, sep, value = text.partition("=")
    try:
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=FRACTION (e.g. dram=0.7), got {text!r}") from None


def _float_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=_int_arg("--prompt-tokens", 1), default=None,
                   help="prompt length TTFT is costed at (default 512, or half of a shorter --context)")
    p.add_argument("--max-new-tokens", type=_int_arg("--max-new-tokens", 0), default=None,
                   help="tokens generated per request (default 512, or the rest of a shorter --context)")
    p.add_argument("--batch-size", type=_int_arg("--batch-size", 1), default=1,
                   help="sequences served at once, each at the context: the KV budget and the decode batch (default 1)")
    p.add_argument("--context", type=_int_arg("--context", 1),
                   help="KV capacity per sequence, the context decode is costed at (default: prompt + new); "
                        "alone, it sets the defaults of prompt and new tokens to fit it")


def _memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-size", type=_int_arg("--page-size", 1), default=DEFAULT_PAGE_SIZE_TOKENS,
                   help=f"KV page size in tokens (default {DEFAULT_PAGE_SIZE_TOKENS})")
    p.add_argument("--watermark", type=_float_arg, default=DEFAULT_WATERMARK,
                   help="with --kv-offload, where a split's KV pages do not all fit: the fraction of the "
                        "VRAM left after weights and working set that the pages kept on the GPU may use "
                        f"(default {DEFAULT_WATERMARK:g})")
    p.add_argument("--kv-offload", action="store_true",
                   help="let GPU-stage KV pages that do not fit in VRAM park in pinned host memory")
    p.add_argument("--gpu-memory", type=_unit_arg("--gpu-memory", parse_bytes), metavar="SIZE",
                   help="cap on VRAM for weights + KV, e.g. 8GiB (as Accelerate's max_memory)")
    p.add_argument("--host-memory", type=_unit_arg("--host-memory", parse_bytes), metavar="SIZE",
                   help="cap on host RAM for CPU weights + host KV, e.g. 16GiB")


def parser() -> argparse.ArgumentParser:
    """helm-plan's command line: every command, its flags and their help."""
    p = argparse.ArgumentParser(prog="helm-plan", description="HELM planner: CPU/GPU split plans for LLM decode.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pr = sub.add_parser("profile", help="measure this machine into a machine profile (YAML)")
    pr.add_argument("-o", "--output", help="write the profile here (default: stdout)")
    pr.add_argument("--quick", action="store_true", help="smaller buffer and fewer runs (seconds, not a minute; "
                                                         "rougher figures)")
    pr.add_argument("--name", help="machine name recorded in the profile (default: host name)")
    pr.add_argument("--threads", type=_int_arg("--threads", 1), help="CPU threads (default: physical cores)")

    ma = sub.add_parser(
        "machine", help="write a machine profile from datasheets (a machine you do not have)",
        description="Write a machine profile from datasheet figures: a GPU and a CPU from the catalogue "
                    "(--list), or explicit figures, which override the catalogue's. Every rate is a datasheet "
                    "peak x an explicit efficiency, recorded with its source in the profile's `datasheet` "
                    "section. Sizes and rates take units: 24GiB, 128GB, 936GB/s, 71TFLOPS. Memory sold as GB "
                    "(VRAM, DIMMs) is binary: write 24GiB for a 24 GB card.",
        epilog="example: helm-plan machine --gpu 'RTX 3090' --cpu 'EPYC 7H12' --ram 128GiB -o m.yaml")
    ma.add_argument("--list", action="store_true", help="print the catalogue of GPUs and CPUs and exit")
    ma.add_argument("--gpu", metavar="NAME", help="a catalogue GPU (e.g. 'RTX 3090', L40S), or a name for --vram etc.")
    ma.add_argument("--cpu", metavar="NAME", help="a catalogue CPU (e.g. 'EPYC 7H12', i7-13700H)")
    ma.add_argument("--ram", type=_unit_arg("--ram", parse_bytes), metavar="SIZE", help="host RAM, e.g. 128GiB (required)")
    ma.add_argument("--ram-available", type=_unit_arg("--ram-available", parse_bytes), metavar="SIZE",
                    help="RAM the model may use (default: RAM less max(2 GiB, 10%%))")
    ma.add_argument("--vram", type=_unit_arg("--vram", parse_bytes), metavar="SIZE", help="GPU memory, e.g. 24GiB")
    ma.add_argument("--hbm", type=_unit_arg("--hbm", parse_rate), metavar="RATE", help="GPU memory bandwidth, e.g. 936GB/s")
    ma.add_argument("--gpu-tflops", type=_unit_arg("--gpu-tflops", parse_flops), metavar="RATE",
                    help="dense FP16/BF16 tensor throughput, e.g. 71TFLOPS (a plain number is GFLOP/s)")
    ma.add_argument("--pcie", metavar="LINK", help="host link: generation x lanes (4x16, gen5x16) or a rate (25GB/s)")
    ma.add_argument("--dram", metavar="MEMORY", help="channels and DIMMs (2ch-DDR5-5200, 8xDDR4-3200) or a rate (83GB/s)")
    ma.add_argument("--cores", type=_int_arg("--cores", 1), help="physical cores for the CPU stage")
    ma.add_argument("--threads", type=_int_arg("--threads", 1), help="logical CPUs (default: the CPU's, or --cores)")
    ma.add_argument("--l3", type=_unit_arg("--l3", parse_bytes), metavar="SIZE", help="last-level cache, e.g. 32MiB")
    ma.add_argument("--cpu-gflops", type=_unit_arg("--cpu-gflops", parse_flops), metavar="RATE",
                    help="fp32 FMA peak of all cores, e.g. 2.1TFLOPS")
    ma.add_argument("--isa", help="comma-separated SIMD features (default: the catalogue CPU's)")
    ma.add_argument("--efficiency", type=_efficiency_arg, action="append", metavar="NAME=X", default=[],
                    help="replace a default efficiency (dram, hbm, link, gpu_compute, cpu_compute), e.g. dram=0.7")
    ma.add_argument("--cuda-reserve", type=_unit_arg("--cuda-reserve", parse_bytes), metavar="SIZE", default=1 << 30,
                    help="VRAM taken by the CUDA context and driver (default 1GiB)")
    ma.add_argument("--link-latency", type=_float_arg, metavar="US", default=10.0,
                    help="microseconds per small host-device copy (default 10)")
    ma.add_argument("--name", help="machine name (default: from the GPU and CPU)")
    ma.add_argument("-o", "--output", help="write the profile here (default: stdout)")

    pl = sub.add_parser("plan", help="trace MODEL, score every split on a machine, write the plan")
    pl.add_argument("model", metavar="MODEL", help="a checkpoint directory or a config.json")
    pl.add_argument("--machine", metavar="FILE", help="machine profile (default: profile this machine, --quick)")
    pl.add_argument("-o", "--output", metavar="PLAN", help="write the plan here (default: stdout)")
    _workload_args(pl)
    _memory_args(pl)
    pl.add_argument("--max-context", action="store_true",
                    help="plan for the longest context any split serves (with --latency-bound: within it); the "
                         "plan's context becomes that length")
    pl.add_argument("--latency-bound", type=_float_arg, metavar="MS",
                    help="with --max-context: the predicted ms/token a split may take at that context")
    pl.add_argument("--split", type=_int_arg("--split", 0), metavar="K",
                    help="force k units on the CPU (still scored and recorded)")
    pl.add_argument("--allow-infeasible", action="store_true", help="with --split: write the plan even if it does not fit")
    pl.add_argument("--dtype", help="weight dtype (default: the config's): bfloat16, float16, float32")
    pl.add_argument("--parent", metavar="PLAN",
                    help="derive from this plan: version + 1, its digest as parent, its calibration (from a plan "
                         "for another machine: η and δ carry, the plan says δ was measured elsewhere)")

    mx = sub.add_parser("matrix", help="plan every MODEL on every machine and print one table",
                        description="Plan every model on every machine profile (the same planning as `helm-plan "
                                    "plan`, with the same workload and memory options) and print one table: split, "
                                    "ms/token, tok/s, TTFT, longest context, or why nothing fits.")
    mx.add_argument("models", metavar="MODEL", nargs="+", help="checkpoint directories or config.json files")
    mx.add_argument("--machines", metavar="PATH", nargs="+", required=True,
                    help="machine profiles, or directories of them (plans/machines)")
    _workload_args(mx)
    _memory_args(mx)
    mx.add_argument("--max-context", action="store_true", help="plan each cell for its longest context")
    mx.add_argument("--latency-bound", type=_float_arg, metavar="MS", help="with --max-context: ms/token bound")
    mx.add_argument("--dtype", help="weight dtype for every model (default: each config's)")
    mx.add_argument("--out-dir", metavar="DIR", help="write each cell's plan here, as MODEL.MACHINE.yaml (then "
                                                     "`helm-plan diff` any two)")
    mx.add_argument("--json", action="store_true", help="print the cells as JSON instead")
    mx.add_argument("--plot", metavar="PNG", help="draw a heatmap of tok/s (needs matplotlib)")

    sh = sub.add_parser("show", help="summary and search table of a plan")
    sh.add_argument("plan", metavar="PLAN", help="a plan YAML")
    sh.add_argument("--json", action="store_true", help="print a JSON object instead")
    sh.add_argument("--plot", metavar="PNG", help="draw T_plan against k with the feasibility boundary (needs matplotlib)")

    va = sub.add_parser("validate", help="check plans / machine profiles against their schemas and digests")
    va.add_argument("files", metavar="FILE", nargs="+", help="plan or machine profile YAML files")

    di = sub.add_parser("diff", help="semantic diff of two plans (exit 0 equal, 1 different, 2 error)")
    di.add_argument("a", metavar="A", help="a plan (or machine profile) YAML")
    di.add_argument("b", metavar="B", help="the plan (or profile) to compare it with")
    di.add_argument("--json", action="store_true", help="print the differences as JSON instead")

    rc = sub.add_parser("recalibrate",
                        help="fit δ and η_kv to the executor's measurements; write the next plan version",
                        description="Fit the per-block overhead δ (and the KV-read efficiency η_kv, given >= 3 context "
                                    "buckets) of every device of PLAN to the executor's measured step times, re-run "
                                    "the search with the calibrated model, write the next plan version, and print "
                                    "measured vs predicted per stage and context bucket, before and after.")
    rc.add_argument("plan", metavar="PLAN", help="the plan the executor measured")
    src = rc.add_mutually_exclusive_group(required=True)
    src.add_argument("--report", metavar="FILE", help="a report written by `helm-executor report -o FILE`")
    src.add_argument("--executor", metavar="HOST:PORT", help="fetch the plan's report from this running daemon")
    rc.add_argument("-o", "--output", metavar="NEW_PLAN", required=True, help="write the next plan version here")
    rc.add_argument("--apply", action="store_true", help="load the new plan into the daemon (--executor) and confirm")
    rc.add_argument("--min-samples", type=_int_arg("--min-samples", 1), default=None,
                    help="decode steps every stage needs (default 20)")
    rc.add_argument("--timeout", type=_float_arg, default=30.0,
                    help="seconds to wait for the daemon's report (default 30)")
    add_credential_flags(rc.add_argument_group("daemon credentials", "with --executor, for a daemon with TLS or --tokens "
                                              "(GetReport and --apply need an admin token)"))

    tr = sub.add_parser("trace", help="trace MODEL and print its partition units (no machine needed)")
    tr.add_argument("model", metavar="MODEL", help="a checkpoint directory or its config.json")
    tr.add_argument("--dtype", help="weight dtype to size it in (default: the config's)")
    tr.add_argument("--json", action="store_true", help="print the units as JSON instead")
    return p
