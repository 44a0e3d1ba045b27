"""Milliseconds the sampler takes per token, against its reference twin, side by side.

    python tools/bench_sampling.py                       # real vocabularies, this machine's threads
    python tools/bench_sampling.py --threads 1 --runs 50

The engine samples every step, for each sequence, after the last stage's logits arrive, so what
sampling takes adds to every token. All figures here are the CPU's (logits on the host), as on a
plan whose last stage is the CPU. `executor.sampling.sample` looks for the candidates among the
most likely tokens first, and for a larger nucleus sorts one bucket of the probabilities' mass;
"before" is the sampler it replaced: `candidates_by_sorting` (the whole vocabulary filtered and
sorted), then torch.multinomial over every token. Two kinds of logits: "peaked" as a trained model's next-token logits often are
(a nucleus of tens of tokens), and "flat" as a random-weight checkpoint's (a nucleus of most of the
vocabulary).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.request_params import SamplingParams  # noqa: E402
from executor.sampling import candidates_by_sorting, make_generator, sample, sample_rows  # noqa: E402

VOCABS = {"Qwen3 / Qwen2.5": 151936, "Llama 3": 128256, "Mistral 7B v0.3": 32768}
BATCH = 16
PARAMS = {
    "temperature 0.7": SamplingParams(temperature=0.7, seed=0),
    "top-k 50": SamplingParams(temperature=0.7, top_k=50, seed=0),
    "top-k 30000": SamplingParams(temperature=0.7, top_k=30000, seed=0),  # past BATCHED_TOP_K: a mask, no sort
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=0),
    "Qwen3's (T 0.6, top-k 20, top-p 0.95)": SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=0),
}


def logits_of(kind: str, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(vocab, generator=g)
    if kind == "flat":
        return x
    return x * 2.0 + torch.where(torch.arange(vocab) % 4999 == 7, 14.0, 0.0)  # a few dominant tokens


def previous_sample(logits: torch.Tensor, params: SamplingParams, generator) -> int:
    """The sampler before it looked among the most likely tokens first: the whole vocabulary
    filtered and sorted (the reference twin), then drawn from by torch.multinomial over every token."""
    ids, probs = candidates_by_sorting(logits, params)
    full = torch.zeros(len(logits), dtype=torch.float64).index_put_((ids,), probs)
    return int(torch.multinomial(full, 1, generator=generator))


def ms_per_call(fn, logits, params, runs: int) -> float:
    gen = make_generator(params)
    fn(logits, params, gen)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(runs):
            fn(logits, params, gen)
        best = min(best, (time.perf_counter() - start) / runs)
    return best * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: every CPU)")
    p.add_argument("--runs", type=int, default=20, help="calls per timing (best of 3)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; ms per sampled token, best of 3 x {args.runs}")
    print("| vocabulary | logits | sampling | nucleus | sample() | before | ratio |")
    print("|---|---|---|---:|---:|---:|---:|")
    for vname, vocab in VOCABS.items():
        for kind in ("peaked", "flat"):
            logits = logits_of(kind, vocab)
            for pname, params in PARAMS.items():
                kept = len(candidates_by_sorting(logits, params)[0])
                new = ms_per_call(sample, logits, params, args.runs)
                ref = ms_per_call(previous_sample, logits, params, args.runs)
                print(f"| {vname} ({vocab}) | {kind} | {pname} | {kept} | {new:.3f} | {ref:.3f} | {ref / new:.1f}x |",
                      flush=True)
    print(f"\nA step of {BATCH} sequences at Qwen3's vocabulary, peaked logits: ms to sample every row, "
          "sample_rows (top-k rows' topk over all of them at once) against row by row")
    print("| sampling | sample_rows | row by row | before, row by row |")
    print("|---|---:|---:|---:|")
    rows = torch.stack([logits_of("peaked", VOCABS["Qwen3 / Qwen2.5"]).roll(7 * r) for r in range(BATCH)])
    for pname, params in PARAMS.items():
        generators = [make_generator(params) for _ in range(BATCH)]
        batch = ms_per_call(lambda x, p, g: sample_rows(x, [p] * BATCH, generators), rows, params, args.runs)
        each = ms_per_call(lambda x, p, g: [sample(row, p, g) for row in x], rows, params, args.runs)
        before = ms_per_call(lambda x, p, g: [previous_sample(row, p, g) for row in x], rows, params,
                             max(1, args.runs // 4))
        print(f"| {pname} | {batch:.3f} | {each:.3f} | {before:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
