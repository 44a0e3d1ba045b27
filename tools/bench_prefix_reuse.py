"""Time to first token of a chat's turns, with prompt prefix reuse and without, side by side.

    python tools/bench_prefix_reuse.py                              # Qwen3-0.6B dims, bf16, 4 turns
    python tools/bench_prefix_reuse.py --turns 6 --user-tokens 400 --threads 2
    python tools/bench_prefix_reuse.py --burst 8 --system-tokens 1024

A chat: each turn's prompt is the whole conversation so far (the previous prompts and replies) and
a new user message of random tokens, as a chat client sends it. Every turn runs twice on one
loaded model, all on the CPU (a plan for the machine's split matters little here: reuse skips the
prompt's chunks on every stage): on an engine that keeps ended requests' K/V
(executor/prefix_cache.py) and on one that computes every prompt in full; the reply of the
first goes into the conversation.

A burst: --burst requests arrive together, each a new system prompt (the same for all, computed by
no one yet) and its own tokens. Three engines: one whose requests wait for the first one's system
prompt pages and start on them (the default), one whose requests compute it side by side
(`wait_for_shared_prefill=False`), one without reuse.

One plan serves both: its KV budget holds max(2, --burst) sequences of the longer context, the
chat's final one or a burst request's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.engine import Engine  # noqa: E402
from executor.loader import load_model  # noqa: E402
from executor.model_config import ModelConfig  # noqa: E402
from executor.plan_io import placement_for  # noqa: E402
from executor.request_params import SamplingParams, StopCriteria  # noqa: E402
from planner.planning import plan_for_split, workload_for  # noqa: E402
from tools.make_model import make_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/qwen3-0.6b", help="checkpoint (built with random weights if missing)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-tokens", type=int, default=256, help="tokens of each new user message")
    parser.add_argument("--reply-tokens", type=int, default=32, help="tokens of each reply")
    parser.add_argument("--burst", type=int, default=4, help="requests in the burst (0: no burst)")
    parser.add_argument("--system-tokens", type=int, default=512, help="the burst's shared system prompt")
    parser.add_argument("--own-tokens", type=int, default=64, help="each burst request's tokens after it")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if min(args.turns, args.user_tokens, args.reply_tokens, args.system_tokens, args.own_tokens) < 1 or args.burst < 0:
        parser.error("--turns, --user-tokens, --reply-tokens, --system-tokens and --own-tokens must be >= 1, "
                     "--burst >= 0")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(f"building a random-weight Qwen3-0.6B (bf16) in {model_dir}", file=sys.stderr)
        make_model(None, "qwen3-0.6b", "bf16", seed=0, out=model_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig.from_dir(model_dir)
    context = max(args.turns * (args.user_tokens + args.reply_tokens) + 1,
                  args.system_tokens + args.own_tokens + args.reply_tokens)
    plan = plan_for_split(model_dir, config.num_units,
                          workload=workload_for(context - args.reply_tokens, args.reply_tokens,
                                                batch_size=max(2, args.burst), context_tokens=context))
    placement = placement_for(plan, config, cpu_threads=args.threads)
    model = load_model(model_dir, placement, config)
    warm, cold = Engine(model, eos_token_ids=()), Engine(model, eos_token_ids=(), prefix_cache=False)
    stop = StopCriteria(max_new_tokens=args.reply_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    # warm-up: a prompt of a turn's size, so the first measured one pays no first-use costs (pages, scratch)
    cold.generate([torch.randint(10, config.vocab_size, (args.user_tokens,), generator=torch.Generator()).tolist()],
                  SamplingParams(), StopCriteria(max_new_tokens=2, ignore_eos=True))

    print(f"bench_prefix_reuse: {config.architecture} {model_dir} ({config.dtype}), all on the CPU, "
          f"{torch.get_num_threads()} threads, {args.user_tokens} user + {args.reply_tokens} reply tokens a turn, "
          f"page {placement.page_size_tokens} tokens")
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'TTFT reuse ms':>14} {'TTFT full ms':>13} {'ratio':>7} "
          f"{'same tokens':>12}")
    history: list[int] = []
    for turn in range(1, args.turns + 1):
        prompt = history + torch.randint(10, config.vocab_size, (args.user_tokens,), generator=gen).tolist()
        reused = warm.generate([prompt], SamplingParams(), stop)[0]
        full = cold.generate([prompt], SamplingParams(), stop)[0]
        print(f"{turn:>4} {len(prompt):>7} {reused.reused_tokens:>7} {reused.ttft_ms:>14.1f} {full.ttft_ms:>13.1f} "
              f"{full.ttft_ms / reused.ttft_ms:>6.2f}x {str(reused.output_ids == full.output_ids):>12}")
        history = prompt + reused.output_ids
    warm.prefix.clear()  # (the engines share the model's KV pools)
    if args.burst:
        burst(model, config, args, stop, gen)
    return 0


def burst(model, config, args, stop, gen) -> None:
    """TTFT of --burst requests arriving together on one new system prompt, per engine."""
    print(f"\nburst: {args.burst} requests arriving together, each {args.system_tokens} system prompt tokens (the "
          f"same, new) + {args.own_tokens} of its own; TTFT in ms")
    print(f"{'engine':>28} {'computed':>9} {'mean TTFT':>10} {'max TTFT':>9} {'vs waiting':>11} {'same tokens':>12}")
    system = torch.randint(10, config.vocab_size, (args.system_tokens,), generator=gen).tolist()
    prompts = [system + torch.randint(10, config.vocab_size, (args.own_tokens,), generator=gen).tolist()
               for _ in range(args.burst)]
    rows = []
    for name, options in (("waits for the system prompt", {}),
                          ("computes it alongside", {"wait_for_shared_prefill": False}),
                          ("no reuse", {"prefix_cache": False})):
        engine = Engine(model, eos_token_ids=(), **options)
        seqs = engine.generate(prompts, SamplingParams(), stop)
        if engine.prefix is not None:
            engine.prefix.clear()  # the next engine starts on no kept pages
        ttfts = [s.ttft_ms for s in seqs]
        rows.append((name, sum(len(s.prompt_ids) - s.reused_tokens for s in seqs), sum(ttfts) / len(ttfts),
                     max(ttfts), [s.output_ids for s in seqs]))
    for name, computed, mean, worst, outputs in rows:
        print(f"{name:>28} {computed:>9} {mean:>10.1f} {worst:>9.1f} {mean / rows[0][2]:>10.2f}x "
              f"{str(outputs == rows[0][4]):>12}")


if __name__ == "__main__":
    sys.exit(main())
