"""`helm-executor`: run a model on a CPU/GPU split, offline or as a gRPC daemon.

    helm-executor generate --model DIR [--plan PLAN | --split K] (--prompt TEXT | --prompt-ids 1,2,3)
                           [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                           [--seed S] [--ignore-eos] [--json] [--report FILE]
    helm-executor serve --plan PLAN [--model DIR] [--host 127.0.0.1] [--port 50051] [--max-queue N]
                        [--plan-dir DIR] [--tokens FILE] [--tls-cert PEM --tls-key PEM] [--metrics-port P]
    helm-executor generate --addr HOST:PORT (--prompt TEXT | --prompt-ids 1,2,3) [--stop STR] ...
    helm-executor report --addr HOST:PORT [-o report.json]
    helm-executor info --addr HOST:PORT [--wait SECONDS]

Each command imports what it uses when it runs: a client command never loads torch or the model.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import replace

from executor.errors import HelmError, RequestError
from planner.step_shape import MAX_RUNNING_SEQUENCES, STREAMED_STEP_TOKENS


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text!r}")
    return port


def _seconds(text: str, zero_ok: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
        raise argparse.ArgumentTypeError(f"expected a number of seconds {'>= 0' if zero_ok else '> 0'}, got {text!r}")
    return value


def _size(text: str) -> int:
    from planner.errors import PlanError
    from planner.units import parse_bytes

    try:
        return parse_bytes(text, "--gpu-memory")   # positive, or PlanError
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _client(args):
    from executor.server.auth import ClientAuth
    from executor.server.client import ExecutorClient

    return ExecutorClient(args.addr, ClientAuth.from_args(args))


def build_parser() -> argparse.ArgumentParser:
    from executor.server.auth import ClientAuth

    parser = argparse.ArgumentParser(prog="helm-executor", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline from a checkpoint, or from a daemon with --addr")
    gen.add_argument("--addr", help="HOST:PORT of a running daemon: stream from it instead of loading the model here")
    gen.add_argument("--model", help="Hugging Face checkpoint directory (offline)")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--plan", help="plan YAML written by helm-plan")
    where.add_argument("--split", type=int, help="partition units on the CPU (0..blocks+2); default: all")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, comma-separated")
    gen.add_argument("--raw-text", action="store_true",
                     help="tokenize --prompt as it is, without the tokenizer's special tokens (e.g. Llama's BOS): "
                          "for text already formatted by a chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily (default)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0: all)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample among the most likely tokens whose probabilities sum to P (default 1: all)")
    gen.add_argument("--seed", type=int, help="seed of the sampler (default: a fresh one each request)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable; with --addr)")
    gen.add_argument("--stop-ids", type=_parse_ids, default=[], help="stop token ids, comma-separated")
    gen.add_argument("--timeout", type=_seconds, help="deadline in seconds (with --addr; default: none)")
    gen.add_argument("--page-size", type=int, help="KV page size in tokens (default: plan's, else 512)")
    gen.add_argument("--device-kv-pages", type=int, help="KV pages the GPU-side stage may hold (default: plan's, else unbounded)")
    gen.add_argument("--threads", type=int, help="CPU-stage threads (default: the plan's profiled cores, else torch's)")
    gen.add_argument("--stream-prefill", type=int, metavar="N",
                     help="with --split: prompt steps of at least N tokens run the CPU stage's blocks on the GPU, "
                          "their weights streamed over the link (where CUDA and flash attention run; a plan "
                          "states its own, partition.stream_prefill_min_rows)")
    gen.add_argument("--kernels", choices=("auto", "helm", "torch"), default="auto",
                     help="CPU-stage kernels: helm (Cython SIMD), torch (reference), auto (helm when built)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--report", metavar="FILE", help="with --plan: write the measured vs predicted step times "
                     "(the report helm-plan recalibrate reads) to FILE")
    gen.add_argument("-v", "--verbose", action="store_true")
    ClientAuth.add_args(gen)

    srv = sub.add_parser("serve", help="run the gRPC daemon (see protos/helm/executor/v1/executor.proto)")
    srv.add_argument("--plan", help="plan YAML to serve; without it the daemon waits NOT_SERVING for LoadPlan")
    srv.add_argument("--model", help="checkpoint directory (default: the plan's model.source)")
    srv.add_argument("--plan-dir", help="directory LoadPlan may read plans from by path (default: none, so "
                                        "LoadPlan takes inline YAML only)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    srv.add_argument("--port", type=_port, default=50051,
                     help="port (default 50051; 0: any free port, logged as 'listening'); one already in use is refused")
    srv.add_argument("--max-batch", type=int, default=MAX_RUNNING_SEQUENCES,
                     help=f"most sequences in the running batch (default {MAX_RUNNING_SEQUENCES}; no more than a "
                          "plan's working memory is priced for: its KV budget's sequences)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="most requests waiting beyond a full batch (default 64; beyond: RESOURCE_EXHAUSTED)")
    srv.add_argument("--max-requests-per-caller", type=int, metavar="N",
                     help="most requests in flight of one caller, told apart by token or client certificate "
                          "(default: half of --max-batch + --max-queue where there are several clients: two client "
                          "tokens or more, or mutual TLS without tokens; else all of them)")
    srv.add_argument("--drain-timeout", type=lambda text: _seconds(text, zero_ok=True), default=30.0,
                     metavar="SECONDS", help="seconds requests in flight may take to finish after SIGTERM, then "
                                             "aborted (default 30; 0 aborts them at once)")
    srv.add_argument("--stall-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                     help="cut off a Generate stream whose client has not read for this long (default 30)")
    srv.add_argument("--gpu-memory", type=_size, metavar="SIZE",
                     help="hold the daemon's GPU allocations to SIZE, e.g. 8GiB (what PyTorch's allocator may "
                          "reserve; the CUDA context comes on top): a plan priced above it is refused at load, an "
                          "allocation beyond it fails its request, not the daemon (default: no cap)")
    srv.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                     help="compute every prompt in full (default: a prompt that starts as an earlier request of the "
                          "same caller did reuses its K/V, kept in the plan's KV budget while room allows)")
    sec = srv.add_argument_group("security", "beyond loopback, the daemon needs TLS and --tokens (or --insecure)")
    sec.add_argument("--tokens", metavar="FILE", help="bearer tokens, one 'client TOKEN' or 'admin TOKEN' per line; "
                     "clients may Generate and Info, admins also LoadPlan, GetPlan and GetReport")
    sec.add_argument("--tls-cert", metavar="PEM", help="TLS certificate chain (with --tls-key): serve over TLS")
    sec.add_argument("--tls-key", metavar="PEM", help="TLS private key")
    sec.add_argument("--tls-client-ca", metavar="PEM", help="mutual TLS: clients must present a certificate "
                     "signed by this CA")
    sec.add_argument("--insecure", action="store_true", help="allow listening beyond loopback without TLS and tokens "
                     "(and metrics beyond loopback)")
    srv.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics (plain HTTP) at /metrics on this "
                     "port (0: any free port, logged as 'metrics'; default: off)")
    srv.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default loopback; "
                     "anything else needs --insecure: the endpoint has no authentication)")
    srv.add_argument("--kernels", choices=("auto", "helm", "torch"), default="auto",
                     help="CPU-stage kernels: helm (Cython SIMD), torch (reference), auto (helm when built; default)")
    srv.add_argument("--threads", type=int, help="CPU-stage threads, for every plan (default: each plan's profiled cores)")
    srv.add_argument("-v", "--verbose", action="store_true", help="debug logs")

    rep = sub.add_parser("report", help="measured vs predicted step time from a running daemon")
    rep.add_argument("--addr", required=True, help="HOST:PORT of the daemon")
    rep.add_argument("-o", "--output", help="write the report as JSON (schemas/report.schema.json)")
    rep.add_argument("--plan-digest", default="", help="a plan the daemon served before (default: the current)")
    rep.add_argument("-v", "--verbose", action="store_true")
    ClientAuth.add_args(rep)

    inf = sub.add_parser("info", help="what a running daemon serves (JSON): model, plan, stages, KV pages, queue")
    inf.add_argument("--addr", required=True, help="HOST:PORT of the daemon")
    inf.add_argument("--wait", type=lambda text: _seconds(text, zero_ok=True), default=0.0, metavar="SECONDS",
                     help="first wait up to this long for the daemon to be SERVING (health check)")
    inf.add_argument("-v", "--verbose", action="store_true")
    ClientAuth.add_args(inf)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.command == "serve":
            from executor.server.serve import serve

            if not args.plan and not args.model:
                raise RequestError("serve needs --plan, or --model to start without a plan")
            return serve(args)
        if args.command == "report":
            return _report(args)
        if args.command == "info":
            return _info(args)
        if args.addr:
            return _generate_remote(args)
        if not args.model:
            raise RequestError("generate needs --model (offline) or --addr (a running daemon)")
        return _generate(args)
    except HelmError as e:
        print(f"helm-executor: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _placement(args, config):
    """(placement, the plan it came from or None): the plan is read and checked once."""
    from executor.placement import Placement
    from executor.plan_io import fit_page_size, load_checked_plan, placement_for

    kv = {}
    if args.page_size is not None:
        kv["page_size_tokens"] = args.page_size
    if args.device_kv_pages is not None:
        kv["device_kv_pages"] = args.device_kv_pages
    if args.plan:
        if args.stream_prefill is not None:
            raise RequestError("--stream-prefill goes with --split: a plan states its own policy "
                               "(partition.stream_prefill_min_rows, priced by its cost model)")
        plan = load_checked_plan(args.plan, args.model, config)
        return placement_for(plan, config, cpu_threads=args.threads, **kv), plan
    if args.stream_prefill is not None and args.split is None:
        raise RequestError("--stream-prefill goes with --split: the CPU stage whose prompt steps stream")
    split = config.num_units if args.split is None else args.split
    placement = Placement.from_split(config.num_units, split, **kv)
    if args.stream_prefill is not None:
        # no plan priced its steps' memory: as large as the engine's steps
        placement = replace(placement, stream_prefill_min_rows=args.stream_prefill,
                            stream_prefill_step_tokens=STREAMED_STEP_TOKENS)
        placement.validate()
    return fit_page_size(placement, config).with_threads(args.threads), None


def _generate(args) -> int:
    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.report import Recorder, kernel_isa
    from executor.tokenizer import IncrementalDecoder, Tokenizer

    if args.stop or args.timeout is not None:
        raise RequestError("--stop and --timeout apply to a daemon (--addr)")
    if args.report and not args.plan:
        raise RequestError("--report measures against a plan's predictions: give --plan")
    if args.report:
        from planner.errors import PlanError
        from planner.yamlio import check_writable

        try:
            check_writable(args.report, "--report")  # before the generation, not after
        except PlanError as e:
            raise RequestError(str(e)) from None
    config = ModelConfig.from_dir(args.model)
    sampling, stop = _sampling_and_stop(args)
    tokenizer = Tokenizer(args.model) if args.prompt is not None or not args.json else None
    if args.prompt is not None:
        prompt_ids = tokenizer.encode(args.prompt, special_tokens=not args.raw_text)
        if not prompt_ids:
            raise RequestError("the prompt is empty: give some text")
    else:
        prompt_ids = args.prompt_ids

    placement, plan = _placement(args, config)
    t0 = time.perf_counter()
    model = load_model(args.model, placement, config, backend=args.kernels)
    load_s = time.perf_counter() - t0
    engine = Engine(model)
    seq = engine.add_request(prompt_ids, sampling, stop)
    recorder = Recorder(plan, args.plan, config.architecture, kernel_isa(model),
                        stream_prefill=model.stream_prefill) if plan is not None else None
    if recorder is not None:
        recorder.attach(engine)

    decoder = IncrementalDecoder(tokenizer) if tokenizer and not args.json else None
    while engine.has_work():
        for event in engine.step():
            if decoder is not None and event.token_id is not None:
                sys.stdout.write(decoder.push(event.token_id))
                sys.stdout.flush()
    if decoder is not None:
        sys.stdout.write(decoder.flush())

    tokenizer = tokenizer or _maybe_tokenizer(args.model)
    text = tokenizer.decode(seq.output_ids) if tokenizer else None
    summary = {
        "token_ids": seq.output_ids,
        "text": text,
        "prompt_tokens": len(prompt_ids),
        "finish_reason": seq.finish_reason,
        "ttft_ms": seq.ttft_ms,
        "decode_tokens_per_s": seq.decode_tokens_per_s,
        "load_s": load_s,
        "split_k": placement.split_k,
        "kernels": kernel_isa(model),
        "cpu_threads": placement.cpu_threads or _torch_threads(),
        "stages": [repr(s) for s in model.stages],
    }
    report = recorder.report() if recorder is not None else None
    if report is not None:
        summary["measured_vs_predicted"] = [
            {"stage": r.stage, "device": r.device, "phase": r.phase, "streamed": bool(r.streamed),
             "context": [r.context_min, r.context_max],
             "steps": r.samples, "measured_ms": r.measured_mean_ms, "predicted_ms": r.predicted_ms,
             "error_pct": r.error_pct} for r in report.rows]
    if args.json:
        print(json.dumps(summary))
    else:
        tps = seq.decode_tokens_per_s
        print(file=sys.stdout)
        print(f"[{len(seq.output_ids)} tokens, finish={seq.finish_reason}, TTFT {seq.ttft_ms:.1f} ms, "
              f"decode {tps:.2f} tok/s, split k={placement.split_k}, kernels {summary['kernels']}, load {load_s:.2f} s]"
              if tps else f"[{len(seq.output_ids)} tokens, finish={seq.finish_reason}, TTFT {seq.ttft_ms:.1f} ms]",
              file=sys.stderr)
        for r in summary.get("measured_vs_predicted", ()):
            print(f"[stage {r['stage']} {r['device']} {r['phase']} context {r['context'][0]}-{r['context'][1]}: "
                  f"{r['steps']} steps, measured {r['measured_ms']:.3f} ms, plan predicted {r['predicted_ms']:.3f} ms "
                  f"({r['error_pct']:+.0f}%)]", file=sys.stderr)
    if args.report:   # after the summary: a file that cannot be written loses nothing else
        try:
            report.write(args.report)
        except (OSError, ValueError) as e:
            raise RequestError(f"cannot write --report {args.report}: {getattr(e, 'strerror', None) or e}") from None
    return 0


def _sampling_and_stop(args):
    from executor.request_params import SamplingParams, StopCriteria

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    stop = StopCriteria(max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop_ids),
                        ignore_eos=args.ignore_eos)
    sampling.validate()
    stop.validate()
    return sampling, stop


def _rpc_error(e) -> int:
    print(f"helm-executor: error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 2


def _generate_remote(args) -> int:
    """Stream a generation from a daemon: text to stdout as it arrives, a summary to stderr."""
    import grpc

    from executor.pb import executor_pb2 as pb
    from executor.server.messages import GenerateSpec, GenerationResult

    offline_only = [f"--{n.replace('_', '-')}" for n in ("plan", "split", "page_size", "device_kv_pages", "threads",
                                                          "stream_prefill", "report")
                    if getattr(args, n) is not None] + (["--kernels"] if args.kernels != "auto" else [])
    if offline_only or args.model:
        raise RequestError(f"{', '.join(offline_only or ['--model'])}: offline only; with --addr the daemon's "
                           "model and plan decide")
    sampling, stop = _sampling_and_stop(args)
    spec = GenerateSpec(prompt_text=args.prompt, prompt_ids=None if args.prompt_ids is None else tuple(args.prompt_ids),
                        sampling=sampling, stop=stop, stop_strings=tuple(args.stop), raw_text=args.raw_text)
    ids, pieces, request_id, result = [], [], "", None
    with _client(args) as client:
        try:
            for msg in client.generate(spec, timeout_s=args.timeout):
                request_id = msg.request_id
                if msg.HasField("token"):
                    ids.append(msg.token.token_id)
                    pieces.append(msg.token.text)
                    if not args.json:
                        sys.stdout.write(msg.token.text)
                        sys.stdout.flush()
                else:
                    result = GenerationResult.from_pb(msg.result, pb)
        except grpc.RpcError as e:
            return _rpc_error(e)
    if result is None:
        print("helm-executor: error: the stream ended without a result", file=sys.stderr)
        return 1
    pieces.append(result.trailing_text)
    stages = [{"stage": s.stage, "device": s.device, "steps": s.steps, "measured_ms": s.measured_ms,
               "predicted_ms": s.predicted_ms} for s in result.stages]
    if args.json:
        print(json.dumps({"request_id": request_id, "token_ids": ids, "text": "".join(pieces),
                          "finish_reason": result.finish_reason, "stop_string": result.stop_string,
                          "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                          "ttft_ms": result.ttft_s * 1e3, "decode_tokens_per_s": result.decode_tokens_per_s,
                          "total_ms": result.total_s * 1e3, "plan": vars(result.plan), "stages": stages}))
        return _finished(result)
    sys.stdout.write(result.trailing_text + "\n")
    per_stage = "; ".join(f"stage {s.stage} {s.device} {s.measured_ms:.3g} ms/step (predicted {s.predicted_ms:.3g})"
                          for s in result.stages)
    p = result.plan
    print(f"[{result.completion_tokens} tokens, finish={result.finish_reason}, TTFT {result.ttft_s * 1e3:.1f} ms, "
          f"decode {result.decode_tokens_per_s:.2f} tok/s, plan v{p.version} {p.digest[:15]}… k={p.split_k}; "
          f"{per_stage}]", file=sys.stderr)
    return _finished(result)


def _finished(result) -> int:
    """0 for a generation that ended as asked (a stop, the length, the context); 1 for one the
    daemon cut short (aborted: its drain ran out of time), whose text is incomplete."""
    if result.finish_reason != "aborted":
        return 0
    print("helm-executor: error: the daemon aborted the request before it finished (it is shutting down)",
          file=sys.stderr)
    return 1


def _report(args) -> int:
    import grpc


    with _client(args) as client:
        try:
            report = client.report(args.plan_digest)
        except grpc.RpcError as e:
            return _rpc_error(e)
    if args.output:
        try:
            report.write(args.output)
        except OSError as e:
            print(f"helm-executor: error: cannot write -o {args.output}: {e.strerror}", file=sys.stderr)
            return 2
    print(report.table())
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _info(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToJson


    with _client(args) as client:
        try:
            if args.wait > 0:
                client.wait_serving(timeout_s=args.wait)
            info = client.info()
        except grpc.RpcError as e:
            return _rpc_error(e)
        except TimeoutError as e:
            print(f"helm-executor: error: {e}", file=sys.stderr)
            return 1
    print(MessageToJson(info, preserving_proto_field_name=True))
    return 0


def _maybe_tokenizer(model_dir):
    from executor.tokenizer import Tokenizer

    try:
        return Tokenizer(model_dir)
    except HelmError:
        return None


if __name__ == "__main__":
    sys.exit(main())
