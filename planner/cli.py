"""helm-plan: trace a model, profile a machine, search every split, write/show/validate/diff plans.

    helm-plan profile [-o machine.yaml] [--quick]
    helm-plan machine [--gpu NAME] [--cpu NAME] --ram SIZE [figures] [-o machine.yaml] | --list
    helm-plan plan MODEL [--machine FILE] [options] [-o PLAN]
    helm-plan matrix MODEL... --machines DIR_OR_FILE... [options] [--out-dir DIR] [--json] [--plot out.png]
    helm-plan show PLAN [--json] [--plot out.png]
    helm-plan validate FILE...
    helm-plan diff A B [--json]
    helm-plan trace MODEL [--json]
    helm-plan recalibrate PLAN (--report REPORT.json | --executor HOST:PORT) -o NEW_PLAN [--apply]

Exit status: 0 success; 1 validate found an invalid file / diff found differences; 2 bad input or
error (a one-line message, never a traceback).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from planner.errors import PlanError
from planner.plan import DEFAULT_PAGE_SIZE_TOKENS, DEFAULT_WATERMARK, Workload
from planner.units import parse_flops, parse_rate

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2
DEFAULT_PROMPT, DEFAULT_NEW = Workload.prompt_tokens, Workload.max_new_tokens  # unless told otherwise


def _err(msg: str) -> None:
    print(f"helm-plan: error: {msg}", file=sys.stderr)


def _write(text: str, out: str | None) -> None:
    if out in (None, "-"):
        sys.stdout.write(text)
        return
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    except OSError as e:
        raise PlanError(f"cannot write {out}: {e.strerror or e}") from None


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


def _size_arg(name: str):
    from planner.units import parse_bytes

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, name)
        except PlanError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _rate_arg(name: str, parse):
    def convert(text: str) -> float:
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
    p.add_argument("--batch-size", type=_int_arg("--batch-size", 1), default=1)
    p.add_argument("--context", type=_int_arg("--context", 1),
                   help="KV capacity per sequence, the context decode is costed at (default: prompt + new); "
                        "alone, it sets the defaults of prompt and new tokens to fit it")


def _memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-size", type=_int_arg("--page-size", 1), default=DEFAULT_PAGE_SIZE_TOKENS,
                   help="KV page size in tokens")
    p.add_argument("--watermark", type=_float_arg, default=DEFAULT_WATERMARK,
                   help="fraction of the VRAM left after weights that KV may use before offloading")
    p.add_argument("--kv-offload", action="store_true", help="let GPU-stage KV pages move to pinned host memory")
    p.add_argument("--gpu-memory", type=_size_arg("--gpu-memory"), metavar="SIZE",
                   help="cap on VRAM for weights + KV, e.g. 8GiB (as Accelerate's max_memory)")
    p.add_argument("--host-memory", type=_size_arg("--host-memory"), metavar="SIZE",
                   help="cap on host RAM for CPU weights + host KV, e.g. 16GiB")


def _workload(args):
    """The workload the flags ask for: a --context given alone adapts the default prompt and new
    tokens to fit it (half each when 512 + 512 do not), explicit ones are kept as given."""
    from planner.planning import workload_for

    if args.context is not None and getattr(args, "max_context", False):
        raise PlanError("--max-context finds the context: give --context or --max-context, not both")
    prompt, new, context = args.prompt_tokens, args.max_new_tokens, args.context
    if context is not None:
        if prompt is None and new is None:
            prompt, new = (DEFAULT_PROMPT, DEFAULT_NEW) if context >= DEFAULT_PROMPT + DEFAULT_NEW else \
                (max(1, context // 2), context - max(1, context // 2))
        elif prompt is None:
            prompt = max(1, min(DEFAULT_PROMPT, context - new))
        elif new is None:
            new = max(0, min(DEFAULT_NEW, context - prompt))
    return workload_for(DEFAULT_PROMPT if prompt is None else prompt, DEFAULT_NEW if new is None else new,
                        args.batch_size, context)


def _parser() -> argparse.ArgumentParser:
    from executor.server.auth import ClientAuth  # the daemon's client flags (grpc only, no torch)

    p = argparse.ArgumentParser(prog="helm-plan", description="HELM planner: CPU/GPU split plans for LLM decode.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pr = sub.add_parser("profile", help="measure this machine into a machine profile (YAML)")
    pr.add_argument("-o", "--output", help="write the profile here (default: stdout)")
    pr.add_argument("--quick", action="store_true", help="smaller buffer and fewer runs (< 10 s)")
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
    ma.add_argument("--ram", type=_size_arg("--ram"), metavar="SIZE", help="host RAM, e.g. 128GiB (required)")
    ma.add_argument("--ram-available", type=_size_arg("--ram-available"), metavar="SIZE",
                    help="RAM the model may use (default: RAM less max(2 GiB, 10%%))")
    ma.add_argument("--vram", type=_size_arg("--vram"), metavar="SIZE", help="GPU memory, e.g. 24GiB")
    ma.add_argument("--hbm", type=_rate_arg("--hbm", parse_rate), metavar="RATE", help="GPU memory bandwidth, e.g. 936GB/s")
    ma.add_argument("--gpu-tflops", type=_rate_arg("--gpu-tflops", parse_flops), metavar="RATE",
                    help="dense FP16/BF16 tensor throughput, e.g. 71TFLOPS (a plain number is GFLOP/s)")
    ma.add_argument("--pcie", metavar="LINK", help="host link: generation x lanes (4x16, gen5x16) or a rate (25GB/s)")
    ma.add_argument("--dram", metavar="MEMORY", help="channels and DIMMs (2ch-DDR5-5200, 8xDDR4-3200) or a rate (83GB/s)")
    ma.add_argument("--cores", type=_int_arg("--cores", 1), help="physical cores for the CPU stage")
    ma.add_argument("--threads", type=_int_arg("--threads", 1), help="logical CPUs (default: the CPU's, or --cores)")
    ma.add_argument("--l3", type=_size_arg("--l3"), metavar="SIZE", help="last-level cache, e.g. 32MiB")
    ma.add_argument("--cpu-gflops", type=_rate_arg("--cpu-gflops", parse_flops), metavar="RATE",
                    help="fp32 FMA peak of all cores, e.g. 2.1TFLOPS")
    ma.add_argument("--isa", help="comma-separated SIMD features (default: the catalogue CPU's)")
    ma.add_argument("--efficiency", type=_efficiency_arg, action="append", metavar="NAME=X", default=[],
                    help="replace a default efficiency (dram, hbm, link, gpu_compute, cpu_compute), e.g. dram=0.7")
    ma.add_argument("--cuda-reserve", type=_size_arg("--cuda-reserve"), metavar="SIZE", default=1 << 30,
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
    sh.add_argument("plan", metavar="PLAN")
    sh.add_argument("--json", action="store_true", help="print a JSON object instead")
    sh.add_argument("--plot", metavar="PNG", help="draw T_plan against k with the feasibility boundary (needs matplotlib)")

    va = sub.add_parser("validate", help="check plans / machine profiles against their schemas and digests")
    va.add_argument("files", metavar="FILE", nargs="+")

    di = sub.add_parser("diff", help="semantic diff of two plans (exit 0 equal, 1 different, 2 error)")
    di.add_argument("a", metavar="A")
    di.add_argument("b", metavar="B")
    di.add_argument("--json", action="store_true")

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
    rc.add_argument("--timeout", type=_float_arg, default=30.0, help="seconds to wait for the daemon's report")
    ClientAuth.add_args(rc.add_argument_group("daemon credentials", "with --executor, for a daemon with TLS or --tokens "
                                              "(GetReport and --apply need an admin token)"))

    tr = sub.add_parser("trace", help="trace MODEL and print its partition units (no machine needed)")
    tr.add_argument("model", metavar="MODEL")
    tr.add_argument("--dtype")
    tr.add_argument("--json", action="store_true")
    return p


def cmd_profile(args) -> int:
    from planner.machine import machine_to_yaml
    from planner.profile import profile_machine, stderr_progress

    machine = profile_machine(quick=args.quick, name=args.name, progress=stderr_progress(), threads=args.threads)
    _write(machine_to_yaml(machine), args.output)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def cmd_machine(args) -> int:
    from planner.datasheet import datasheet_machine, format_catalogue
    from planner.machine import machine_to_yaml

    if args.list:
        print(format_catalogue())
        return EXIT_OK
    if args.ram is None:
        raise PlanError("--ram is required (host RAM, e.g. --ram 64GiB); --list shows the catalogue")
    if args.link_latency < 0:
        raise PlanError(f"--link-latency must be >= 0, got {args.link_latency}")
    machine = datasheet_machine(
        ram_bytes=args.ram, gpu=args.gpu, cpu=args.cpu, ram_available_bytes=args.ram_available,
        vram_bytes=args.vram, hbm_gibps=args.hbm, gpu_gflops=args.gpu_tflops, pcie=args.pcie, dram=args.dram,
        cores=args.cores, threads=args.threads, l3_bytes=args.l3, cpu_gflops=args.cpu_gflops,
        isa=tuple(x.strip() for x in args.isa.split(",") if x.strip()) if args.isa is not None else None,
        efficiency=dict(args.efficiency), cuda_reserve_bytes=args.cuda_reserve,
        link_latency_us=args.link_latency, name=args.name)
    _write(machine_to_yaml(machine), args.output)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def cmd_plan(args) -> int:
    from planner.machine import load_machine
    from planner.plan import load_plan
    from planner.planning import make_plan
    from planner.show import format_summary

    from planner.config import read_config

    started = time.perf_counter()
    read_config(args.model)  # a bad path or malformed config fails before any profiling
    workload = _workload(args)
    if args.machine:
        machine = load_machine(args.machine)
    else:
        from planner.profile import profile_machine, stderr_progress
        print("helm-plan: no --machine given: profiling this machine (--quick)", file=sys.stderr)
        machine = profile_machine(quick=True, progress=stderr_progress())
    parent = load_plan(args.parent) if args.parent else None
    plan = make_plan(args.model, machine, workload=workload, page_size_tokens=args.page_size,
                     watermark=args.watermark, kv_offload=args.kv_offload, gpu_memory_bytes=args.gpu_memory,
                     host_memory_bytes=args.host_memory, split_k=args.split,
                     allow_infeasible=args.allow_infeasible, dtype=args.dtype, parent=parent,
                     max_context=args.max_context, latency_bound_ms=args.latency_bound)
    from planner.schema import validate
    validate(plan.to_dict(), "plan", "new plan")  # never write a plan the executor would reject
    _write(plan.to_yaml(), args.output)
    print(format_summary(plan), file=sys.stderr)
    print(f"helm-plan: planned in {time.perf_counter() - started:.2f} s"
          f"{f'; wrote {args.output}' if args.output else ''}", file=sys.stderr)
    return EXIT_OK


def cmd_matrix(args) -> int:
    from planner.matrix import format_matrix, load_machines, matrix_json, plan_matrix, plot_matrix

    started = time.perf_counter()
    workload = _workload(args)
    machines = load_machines(args.machines)
    cells = plan_matrix(args.models, machines, out_dir=args.out_dir,
                        progress=lambda msg: print(f"helm-plan: {msg}", file=sys.stderr),
                        workload=workload, page_size_tokens=args.page_size, watermark=args.watermark,
                        kv_offload=args.kv_offload, gpu_memory_bytes=args.gpu_memory,
                        host_memory_bytes=args.host_memory, dtype=args.dtype, max_context=args.max_context,
                        latency_bound_ms=args.latency_bound)
    if args.json:
        print(json.dumps(matrix_json(cells), indent=2))
    else:
        print(format_matrix(cells))
        written = [c for c in cells if c.plan_file]
        if len(written) >= 2:
            print(f"compare two cells: helm-plan diff {written[0].plan_file} {written[1].plan_file}")
        elif args.out_dir is None:
            print("write every cell's plan with --out-dir DIR, then `helm-plan diff` any two")
    if args.plot:
        plot_matrix(cells, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    print(f"helm-plan: {len(cells)} cells in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return EXIT_OK


def cmd_show(args) -> int:
    from planner.plan import load_plan
    from planner.show import format_summary, format_table, plot_plan, show_json

    plan = load_plan(args.plan)
    if args.json:
        print(json.dumps(show_json(plan), indent=2))
    else:
        print(format_summary(plan))
        print()
        print(format_table(plan))
    if args.plot:
        plot_plan(plan, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return EXIT_OK


def cmd_validate(args) -> int:
    from planner.machine import is_machine_profile, machine_from_dict
    from planner.plan import plan_from_dict
    from planner.yamlio import read_yaml

    bad = 0
    for name in args.files:
        try:
            if not Path(name).is_file():
                raise PlanError("no such file")
            data, _ = read_yaml(Path(name), "file")
            kind = data.get("kind") if isinstance(data, dict) else None
            if is_machine_profile(data):
                m = machine_from_dict(data, "machine profile")
                print(f"ok    {name}: machine profile {m.name} ({m.source})")
            elif kind == "plan":
                p = plan_from_dict(data, "plan")
                print(f"ok    {name}: plan v{p.plan_version} {p.model.architecture} on {p.machine.name}, "
                      f"k={p.partition.split_k}, {p.digest[:19]}…")
            else:
                raise PlanError(f"field 'kind' is {kind!r}: expected 'plan' or 'machine_profile'")
        except PlanError as e:
            bad += 1
            print(f"FAIL  {name}: {e}")
    return EXIT_DIFFERENT if bad else EXIT_OK


def cmd_diff(args) -> int:
    from planner.diff import diff_json, diff_plans, format_diff
    from planner.plan import load_plan

    a, b = load_plan(args.a), load_plan(args.b)
    changes = diff_plans(a, b)
    if args.json:
        print(json.dumps(diff_json(a, b, changes), indent=2))
    else:
        sys.stdout.write(format_diff(a, b, changes, args.a, args.b))
    return EXIT_DIFFERENT if changes else EXIT_OK


def cmd_trace(args) -> int:
    from planner.serial import to_dict
    from planner.trace import trace_model
    from planner.units import fmt_bytes

    ir = trace_model(args.model, args.dtype)
    if args.json:
        print(json.dumps(to_dict(ir), indent=2))
        return EXIT_OK
    print(f"{ir.architecture} ({ir.dtype}): {ir.num_blocks} blocks, {ir.num_units} units, "
          f"{ir.num_params / 1e9:.3f} B params, {fmt_bytes(ir.weight_bytes)}")
    print(f"{'unit':>4} {'kind':<9} {'weights':>10} {'read/tok':>10} {'act/tok':>9} {'kv/tok':>8} "
          f"{'F_proj/tok':>12} {'F_attn/ctx':>10} {'nodes':>5}  modules")
    for u in ir.units:
        reuse = f" (trace of unit {u.traced_as})" if u.traced_as != u.index else ""
        print(f"{u.index:>4} {u.kind:<9} {fmt_bytes(u.weight_bytes):>10} {fmt_bytes(u.read_bytes_per_token):>10} "
              f"{fmt_bytes(u.act_bytes_per_token):>9} {fmt_bytes(u.kv_bytes_per_token):>8} "
              f"{u.proj_flops_per_token:>12} {u.attn_flops_per_context_token:>10} {u.num_nodes:>5}  "
              f"{', '.join(u.weights)}{reuse}")
    for s in ir.shared_weights:
        print(f"shared: {s.name} ({fmt_bytes(s.weight_bytes)}) used by units {', '.join(map(str, s.units))}")
    return EXIT_OK


def cmd_recalibrate(args) -> int:
    """Everything is read, checked and fitted before anything is written: bad input writes nothing."""
    from executor.errors import CredentialError
    from executor.server.auth import ClientAuth
    from planner.calibrate import MIN_STAGE_SAMPLES, format_table, recalibrate
    from planner.daemon_client import apply_plan, check_addr, fetch_report
    from planner.report import read_report
    from planner.plan import load_plan
    from planner.schema import validate

    if args.apply and not args.executor:
        raise PlanError("--apply loads the new plan into a running daemon: give its address with --executor "
                        "HOST:PORT (with --report, load it yourself: LoadPlan)")
    out = Path(args.output)
    if out.exists() and out.resolve() == Path(args.plan).resolve():
        raise PlanError(f"-o {args.output} is PLAN itself: write the next version to a new file (the parent stays "
                        "as the executor measured it)")
    auth = None
    if args.executor:
        check_addr(args.executor)
        try:
            auth = ClientAuth.from_args(args)
        except CredentialError as e:
            raise PlanError(str(e)) from None
    plan = load_plan(args.plan)
    if args.executor:
        report, source, label = fetch_report(args.executor, plan, args.timeout, auth), f"daemon {args.executor}", \
            f"the report of the daemon at {args.executor}"
    else:
        report, source, label = read_report(args.report), f"report {args.report}", f"report {args.report}"
    result = recalibrate(plan, report, source, args.min_samples or MIN_STAGE_SAMPLES, label)
    validate(result.plan.to_dict(), "plan", "new plan")  # never write a plan the executor would reject
    text = result.plan.to_yaml()
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PlanError(f"cannot write {args.output}: {e.strerror or e}") from None
    print(format_table(result))
    print(f"wrote {args.output}: plan v{result.plan.plan_version} {result.plan.digest[:19]}…, parent "
          f"{plan.digest[:19]}…")
    if args.apply:
        try:
            print(apply_plan(args.executor, result.plan, auth=auth))
        except PlanError as e:
            raise PlanError(f"{e} (the new plan is written to {args.output}; it was not applied)") from None
    return EXIT_OK


COMMANDS = {"profile": cmd_profile, "machine": cmd_machine, "plan": cmd_plan, "matrix": cmd_matrix, "show": cmd_show, "validate": cmd_validate,
            "diff": cmd_diff, "trace": cmd_trace, "recalibrate": cmd_recalibrate}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except PlanError as e:
        _err(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
