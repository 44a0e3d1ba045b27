"""Benchmark: HELM's executor versus Hugging Face transformers decoding the same checkpoint.

Both run on the CPU with the same threads, batch 1, a fixed prompt, greedy, a fixed number of new
tokens (EOS ignored); runs alternate (HELM, HF, HELM, HF, ...) so machine noise hits both alike.
Printed per run and as medians: TTFT, decode tok/s, achieved GB/s (weight bytes read per decode
token × tok/s), its fraction of the DRAM read bandwidth measured in the same run, and HELM/HF.

    python tools/bench_decode.py --model models/qwen3-0.6b        # built with tools/make_model.py if missing
    python tools/bench_decode.py --model models/qwen3-1.7b --size qwen3-1.7b
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python tools/bench_decode.py`
    sys.path.insert(0, str(REPO))


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step reads: every block and the output projection (the embedding
    is a row lookup)."""
    total, seen = 0, set()
    for stage in model.stages:
        for block in stage.blocks:
            for lin in (block.qkv, block.o, block.gate_up, block.down):
                total += lin.weight.numel() * lin.weight.element_size()
        if stage.head is not None:
            w = stage.head.lm_head.weight
            if w.data_ptr() not in seen:
                seen.add(w.data_ptr())
                total += w.numel() * w.element_size()
    return total


def read_gbps(threads: int, nbytes: int = 2 << 30) -> float:
    """DRAM read bandwidth now: the kernels' multi-stream read over a buffer far larger than L3."""
    from executor import kernels

    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    kernels.kernels.read_pass(buf, num_threads=threads)  # warm-up (page faults)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        kernels.kernels.read_pass(buf, num_threads=threads)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


RSS_CHILD = r"""
import json, resource, sys
import torch
from executor.engine import Engine
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.sampling import StopCriteria
from tools.bench_decode import weight_bytes_per_token

model_dir, prompt_tokens, new_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
config = ModelConfig.from_dir(model_dir)
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = load_model(model_dir, Placement.from_split(config.num_units, config.num_units), config)
engine = Engine(model, eos_token_ids=())
prompt = [1000 + (i * 7919) % 50000 % (config.vocab_size - 1000) for i in range(prompt_tokens)]
engine.add_request(prompt, stop=StopCriteria(max_new_tokens=new_tokens, ignore_eos=True))
kv_bytes = 0
while engine.has_work():
    engine.step()
    kv_bytes = max(kv_bytes, sum(s.kv.device_pool.used_pages * s.kv.device_pool.page_bytes
                                 for s in model.stages if s.kv is not None))
emb = model.stages[0].embedding
weights = weight_bytes_per_token(model)
if emb is not None and all(emb.data_ptr() != s.head.lm_head.weight.data_ptr() for s in model.stages if s.head):
    weights += emb.numel() * emb.element_size()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"baseline": baseline, "peak": peak, "weights": weights, "kv": kv_bytes}))
"""


def peak_rss(model_dir: str, prompt_tokens: int, new_tokens: int, threads: int) -> dict:
    """Peak RSS of a HELM decode run alone, in a fresh process: growth over the process's
    baseline (Python, torch, the executor imported) next to weights + KV pages allocated."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", RSS_CHILD, model_dir, str(prompt_tokens), str(new_tokens),
                          str(threads)], capture_output=True, text=True, check=True,
                         cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_helm(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    from executor.engine import Engine
    from executor.sampling import StopCriteria

    engine = Engine(model, eos_token_ids=())
    seq = engine.generate([prompt], stop=StopCriteria(max_new_tokens=new_tokens, ignore_eos=True))[0]
    return seq.ttft_ms, seq.decode_tokens_per_s


def run_hf(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + new_tokens
    return ttft * 1e3, (new_tokens - 1) / (total - ttft)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/qwen3-0.6b")
    parser.add_argument("--size", default="qwen3-0.6b", help="preset to build if --model is missing")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="alternating runs of each engine")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if not (Path(args.model) / "config.json").is_file():
        from tools.make_model import make_model

        print(f"building {args.size} (bf16, random weights) in {args.model}", file=sys.stderr)
        make_model(None, args.size, "bf16", 0, args.model)
    rss = peak_rss(args.model, args.prompt_tokens, args.new_tokens, args.threads)

    from transformers import AutoModelForCausalLM

    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.placement import Placement
    from executor.report import kernel_isa

    config = ModelConfig.from_dir(args.model)
    helm = load_model(args.model, Placement.from_split(config.num_units, config.num_units), config)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=config.dtype).eval()
    nbytes = weight_bytes_per_token(helm)
    prompt = [1000 + (i * 7919) % 50000 % (config.vocab_size - 1000) for i in range(args.prompt_tokens)]

    print(f"{args.model}: {nbytes / 1e9:.2f} GB of weights per decode token, {config.dtype}, "
          f"prompt {args.prompt_tokens}, {args.new_tokens} new tokens, {args.threads} threads, "
          f"HELM kernels {kernel_isa(helm)}")
    run_helm(helm, prompt[:8], 4)  # warm up both
    run_hf(hf, prompt[:8], 4)
    rows = {"helm": [], "hf": []}
    print(f"{'run':>4} {'engine':>6} {'read GB/s':>9} {'TTFT ms':>8} {'tok/s':>7} {'GB/s':>6} {'of read':>7}")
    for r in range(args.runs):
        for name, fn, model in (("helm", run_helm, helm), ("hf", run_hf, hf)):
            bw = read_gbps(args.threads)
            ttft, tps = fn(model, prompt, args.new_tokens)
            rows[name].append((bw, ttft, tps))
            print(f"{r + 1:>4} {name:>6} {bw:>9.1f} {ttft:>8.0f} {tps:>7.2f} {tps * nbytes / 1e9:>6.1f} "
                  f"{tps * nbytes / 1e9 / bw:>6.0%}")
    med = {k: [statistics.median(col) for col in zip(*v)] for k, v in rows.items()}
    (hbw, httft, htps), (_, fttft, ftps) = med["helm"], med["hf"]
    print(f"median: HELM {htps:.2f} tok/s ({htps * nbytes / 1e9 / hbw:.0%} of read bandwidth), TTFT {httft:.0f} ms; "
          f"HF {ftps:.2f} tok/s, TTFT {fttft:.0f} ms")
    print(f"HELM/HF decode {htps / ftps:.2f}x, TTFT ratio HELM/HF {httft / fttft:.2f}")
    grown, budget = rss["peak"] - rss["baseline"], rss["weights"] + rss["kv"]
    print(f"peak RSS of a HELM decode run (own process): +{grown / 2**20:.0f} MiB over its baseline for "
          f"{rss['weights'] / 2**20:.0f} MiB of weights + {rss['kv'] / 2**20:.0f} MiB of KV pages "
          f"= {grown / budget:.1%} of weights + KV (target <= 110%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
