"""helm-plan: trace a model, profile a machine, search every split, write/show/validate/diff plans.

    helm-plan profile [-o machine.yaml] [--quick]
    helm-plan plan MODEL [--machine FILE] [options] [-o PLAN]
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
import sys
import time
from pathlib import Path

from planner.errors import PlanError

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


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


def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    from executor.server.auth import ClientAuth  # the daemon's client flags (grpc only, no torch)

    p = argparse.ArgumentParser(prog="helm-plan", description="HELM planner: CPU/GPU split plans for LLM decode.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pr = sub.add_parser("profile", help="measure this machine into a machine profile (YAML)")
    pr.add_argument("-o", "--output", help="write the profile here (default: stdout)")
    pr.add_argument("--quick", action="store_true", help="smaller buffer and fewer runs (< 10 s)")
    pr.add_argument("--name", help="machine name recorded in the profile (default: host name)")
    pr.add_argument("--threads", type=_int_arg("--threads", 1), help="CPU threads (default: physical cores)")

    pl = sub.add_parser("plan", help="trace MODEL, score every split on a machine, write the plan")
    pl.add_argument("model", metavar="MODEL", help="a checkpoint directory or a config.json")
    pl.add_argument("--machine", metavar="FILE", help="machine profile (default: profile this machine, --quick)")
    pl.add_argument("-o", "--output", metavar="PLAN", help="write the plan here (default: stdout)")
    pl.add_argument("--prompt-tokens", type=_int_arg("--prompt-tokens", 1), default=512)
    pl.add_argument("--max-new-tokens", type=_int_arg("--max-new-tokens", 0), default=512)
    pl.add_argument("--batch-size", type=_int_arg("--batch-size", 1), default=1)
    pl.add_argument("--context", type=_int_arg("--context", 1),
                    help="KV capacity per sequence, the context decode is costed at (default: prompt + new)")
    pl.add_argument("--page-size", type=_int_arg("--page-size", 1), default=512, help="KV page size in tokens")
    pl.add_argument("--watermark", type=_float_arg, default=0.8,
                    help="fraction of the VRAM left after weights that KV may use before offloading")
    pl.add_argument("--kv-offload", action="store_true", help="let GPU-stage KV pages move to pinned host memory")
    pl.add_argument("--gpu-memory", type=_size_arg("--gpu-memory"), metavar="SIZE",
                    help="cap on VRAM for weights + KV, e.g. 8GiB (as Accelerate's max_memory)")
    pl.add_argument("--host-memory", type=_size_arg("--host-memory"), metavar="SIZE",
                    help="cap on host RAM for CPU weights + host KV, e.g. 16GiB")
    pl.add_argument("--split", type=_int_arg("--split", 0), metavar="K",
                    help="force k units on the CPU (still scored and recorded)")
    pl.add_argument("--allow-infeasible", action="store_true", help="with --split: write the plan even if it does not fit")
    pl.add_argument("--dtype", help="weight dtype (default: the config's): bfloat16, float16, float32")
    pl.add_argument("--parent", metavar="PLAN",
                    help="derive from this plan: version + 1, its digest as parent, its calibration (from a plan "
                         "for another machine: η and δ carry, the plan says δ was measured elsewhere)")

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


def cmd_plan(args) -> int:
    from planner.machine import load_machine
    from planner.plan import load_plan, make_plan, workload_for
    from planner.show import format_summary

    from planner.config import read_config

    started = time.perf_counter()
    read_config(args.model)  # a bad path or malformed config fails before any profiling
    if args.machine:
        machine = load_machine(args.machine)
    else:
        from planner.profile import profile_machine, stderr_progress
        print("helm-plan: no --machine given: profiling this machine (--quick)", file=sys.stderr)
        machine = profile_machine(quick=True, progress=stderr_progress())
    parent = load_plan(args.parent) if args.parent else None
    workload = workload_for(args.prompt_tokens, args.max_new_tokens, args.batch_size, args.context)
    plan = make_plan(args.model, machine, workload=workload, page_size_tokens=args.page_size,
                     watermark=args.watermark, kv_offload=args.kv_offload, gpu_memory_bytes=args.gpu_memory,
                     host_memory_bytes=args.host_memory, split_k=args.split,
                     allow_infeasible=args.allow_infeasible, dtype=args.dtype, parent=parent)
    from planner.schema import validate
    validate(plan.to_dict(), "plan", "new plan")  # never write a plan the executor would reject
    _write(plan.to_yaml(), args.output)
    print(format_summary(plan), file=sys.stderr)
    print(f"helm-plan: planned in {time.perf_counter() - started:.2f} s"
          f"{f'; wrote {args.output}' if args.output else ''}", file=sys.stderr)
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
    from planner.machine import machine_from_dict
    from planner.plan import plan_from_dict
    from planner.yamlio import read_yaml

    bad = 0
    for name in args.files:
        try:
            if not Path(name).is_file():
                raise PlanError("no such file")
            data, _ = read_yaml(Path(name), "file")
            kind = data.get("kind") if isinstance(data, dict) else None
            if kind == "machine_profile":
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
    from planner.calibrate import (MIN_STAGE_SAMPLES, apply_plan, check_addr, fetch_report, format_table,
                                   read_report, recalibrate)
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


COMMANDS = {"profile": cmd_profile, "plan": cmd_plan, "show": cmd_show, "validate": cmd_validate,
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
