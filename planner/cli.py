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
error (a one-line message, never a traceback). Each command imports what it uses when it runs, so
`helm-plan --help` and `helm-plan show` answer without loading torch and transformers.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from planner.cli_args import parser
from planner.errors import PlanError
from planner.plan import Workload

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


def cmd_profile(args) -> int:
    from planner.machine import machine_to_yaml
    from planner.profile import profile_machine, stderr_progress
    from planner.yamlio import check_writable

    if args.output not in (None, "-"):
        check_writable(args.output, "-o", make_parents=True)  # before measuring, not after
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
    from planner.calibrate import MIN_STAGE_SAMPLES, format_table, recalibrate
    from planner.daemon_client import apply_plan, check_addr, client_auth, fetch_report
    from planner.plan import load_plan
    from planner.report import read_report
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
        auth = client_auth(args)
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
    args = parser().parse_args(argv)
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
