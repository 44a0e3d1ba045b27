"""`helm-executor`: run a model on a CPU/GPU split.

    helm-executor generate --model DIR [--plan PLAN | --split K] (--prompt TEXT | --prompt-ids 1,2,3)
                           [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                           [--seed S] [--ignore-eos] [--json]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from executor.errors import HelmError, RequestError


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helm-executor", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline (no daemon) from a checkpoint")
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--plan", help="plan YAML written by helm-plan")
    where.add_argument("--split", type=int, help="partition units on the CPU (0..blocks+2); default: all")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, comma-separated")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--page-size", type=int, help="KV page size in tokens (default: plan's, else 512)")
    gen.add_argument("--device-kv-pages", type=int, help="KV pages the GPU-side stage may hold (default: plan's, else unbounded)")
    gen.add_argument("--kernels", choices=("auto", "helm", "torch"), default="auto",
                     help="CPU-stage kernels: helm (Cython SIMD), torch (reference), auto (helm when built)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.command == "generate":
            return _generate(args)
    except HelmError as e:
        print(f"helm-executor: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _placement(args, config):
    from executor.placement import Placement

    kv = {}
    if args.page_size is not None:
        kv["page_size_tokens"] = args.page_size
    if args.device_kv_pages is not None:
        kv["device_kv_pages"] = args.device_kv_pages
    if args.plan:
        from executor.plan_io import placement_from_plan

        return placement_from_plan(args.plan, args.model, config, **kv)
    split = config.num_units if args.split is None else args.split
    return Placement.from_split(config.num_units, split, **kv)


def _generate(args) -> int:
    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.sampling import SamplingParams, StopCriteria
    from executor.tokenizer import IncrementalDecoder, Tokenizer

    config = ModelConfig.from_dir(args.model)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    stop = StopCriteria(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    sampling.validate()
    stop.validate()
    tokenizer = Tokenizer(args.model) if args.prompt is not None or not args.json else None
    if args.prompt is not None:
        prompt_ids = tokenizer.encode(args.prompt)
        if not prompt_ids:
            raise RequestError("the prompt is empty: give some text")
    else:
        prompt_ids = args.prompt_ids

    placement = _placement(args, config)
    t0 = time.perf_counter()
    model = load_model(args.model, placement, config, backend=args.kernels)
    load_s = time.perf_counter() - t0
    engine = Engine(model)
    seq = engine.add_request(prompt_ids, sampling, stop)

    decoder = IncrementalDecoder(tokenizer) if tokenizer and not args.json else None
    while engine.has_work():
        for event in engine.step():
            if decoder is not None and event.token_id is not None:
                sys.stdout.write(decoder.push(event.token_id))
                sys.stdout.flush()

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
        "kernels": _kernel_label(model),
        "stages": [repr(s) for s in model.stages],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        tps = seq.decode_tokens_per_s
        print(file=sys.stdout)
        print(f"[{len(seq.output_ids)} tokens, finish={seq.finish_reason}, TTFT {seq.ttft_ms:.1f} ms, "
              f"decode {tps:.2f} tok/s, split k={placement.split_k}, kernels {summary['kernels']}, load {load_s:.2f} s]"
              if tps else f"[{len(seq.output_ids)} tokens, finish={seq.finish_reason}, TTFT {seq.ttft_ms:.1f} ms]",
              file=sys.stderr)
    return 0


def _kernel_label(model) -> str:
    """The CPU kernels in use, with the instruction set (it belongs with every measurement)."""
    backends = {s.backend for s in model.stages if s.device.type == "cpu"}
    if "helm" in backends:
        from executor.kernels import KERNEL_ISA

        return f"helm-{KERNEL_ISA}"
    return "torch" if backends else "none"


def _maybe_tokenizer(model_dir):
    from executor.tokenizer import Tokenizer

    try:
        return Tokenizer(model_dir)
    except HelmError:
        return None


if __name__ == "__main__":
    sys.exit(main())
