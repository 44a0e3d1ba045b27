"""Benchmark: HELM's executor against Hugging Face transformers and (with --llama-cpp) llama.cpp
on the same random-weight checkpoints: TTFT per prompt length and decode tok/s, per model size
and weight dtype, with the ratio to each peer.

All run on the CPU with the same threads, batch 1, greedy, EOS ignored. In each of --runs runs,
every measurement runs the engines back to back, HELM next to each peer, in an order that flips
from run to run; each ratio is taken within a run and the table shows the median of those paired
ratios (and their range), since a shared machine's bandwidth can swing by a third within a
minute, more than the gaps being measured; the times shown are medians over the runs.
Decode: --new-tokens after a 128-token prompt; TTFT: the prompt and its first token; with
--depths, decode again with that many tokens already in the cache (long contexts read more KV than
weights per token: the attention kernels' share). llama.cpp runs through
../shared/anchors/llama-cpp.sh (llama-bench on a GGUF of the same weights; its TTFT is the prompt
at its measured prompt-processing rate, its decode a run from an empty context); at a depth,
llama-bench itself (`-d`) on the GGUF the anchor made, its untimed prompt filling the cache. transformers' bf16 prompt GEMMs are slow on CPUs without AVX512-BF16/AMX: prompts
longer than --hf-max-prompt are left out for it. Also printed: the decode's share of the DRAM read
bandwidth measured in the same run, and a HELM decode run's peak RSS in its own process.

    python tools/bench_decode.py                                   # Qwen3-0.6B bf16, HELM vs HF
    python tools/bench_decode.py --sizes qwen3-0.6b,qwen3-1.7b --dtypes bf16,fp16 \
        --prompts 128,512,2048 --llama-cpp --runs 2                # the issue-15 table
    python tools/bench_decode.py --prompts 128 --depths 4096,16384 --llama-cpp --hf-max-prompt 0
"""
from __future__ import annotations

import argparse
import os
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
    kernels.default_set.read_pass(buf, num_threads=threads)  # warm-up (page faults)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        kernels.default_set.read_pass(buf, num_threads=threads)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


RSS_CHILD = r"""
import json, sys
import torch
from executor.engine import Engine
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.request_params import StopCriteria
from tools.bench_decode import weight_bytes_per_token

model_dir, prompt_tokens, new_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def peak_rss_bytes():
    # VmHWM: this process's own high-water mark. ru_maxrss is not: Linux carries the parent's
    # high-water mark over fork and exec, so a child of a big benchmark process would report it.
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


torch.set_num_threads(threads)
config = ModelConfig.from_dir(model_dir)
baseline = peak_rss_bytes()
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
peak = peak_rss_bytes()
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
    from executor.request_params import StopCriteria

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


LLAMA_CPP = REPO.parent / "shared" / "anchors" / "llama-cpp.sh"


def run_llama_cpp(model_dir: str, dtype: str, prompt_tokens: int, new_tokens: int, threads: int) -> dict:
    """One llama-bench measurement through the anchor script: {ttft_ms, tg_tokens_per_s, ...}."""
    import json
    import subprocess

    gguf_dtype = {"bf16": "bf16", "fp16": "f16"}[dtype]
    out = subprocess.run(["bash", str(LLAMA_CPP), model_dir, gguf_dtype, str(prompt_tokens), str(new_tokens),
                          str(threads)], capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp anchor failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_at_depth(model_dir: str, dtype: str, depth: int, new_tokens: int, threads: int) -> float:
    """llama.cpp's decode tok/s with `depth` tokens in its cache: llama-bench `-d` on the GGUF the
    anchor built (run_llama_cpp first: it builds llama-bench and converts the checkpoint), found
    where the anchor keeps it, by the anchor's own key (the checkpoint's path and files' mtimes)."""
    import json
    import subprocess

    gguf_dtype = {"bf16": "bf16", "fp16": "f16"}[dtype]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "helm-anchors"
    version = next(line.split("=", 1)[1].strip() for line in LLAMA_CPP.read_text().splitlines()
                   if line.startswith("VER="))  # the anchor's llama.cpp, not an older build beside it
    bench = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-bench"
    key = subprocess.run(["bash", "-c", 'ckpt=$(cd "$1" && pwd); echo "$ckpt $(stat -c %Y "$ckpt"/*.safetensors '
                          '| sort | tr \'\\n\' \' \')" | sha1sum | cut -c1-12', "-", model_dir],
                         capture_output=True, text=True, check=True).stdout.strip()
    gguf = cache / "gguf" / f"{key}-{gguf_dtype}.gguf"
    if not bench.is_file() or not gguf.is_file():
        raise RuntimeError(f"llama.cpp at a depth needs the anchor's llama-bench and {gguf}: run the anchor first")
    out = subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(new_tokens),
                          "-d", str(depth), "-r", "1", "-o", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench -d {depth} failed: {out.stderr.strip()[-500:]}")
    return next(r["avg_ts"] for r in json.loads(out.stdout) if r["n_gen"])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench_model(args, size: str, dtype: str) -> dict:
    """Every measurement of one checkpoint; prints as it goes, returns the medians."""
    from transformers import AutoModelForCausalLM

    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.placement import Placement
    from executor.report import kernel_isa

    model_dir = f"models/{size}" if dtype == "bf16" else f"models/{size}-{dtype}"
    if not (Path(model_dir) / "config.json").is_file():
        from tools.make_model import make_model

        print(f"building {size} ({dtype}, random weights) in {model_dir}", file=sys.stderr)
        make_model(None, size, dtype, 0, model_dir)
    rss = peak_rss(model_dir, 128, args.new_tokens, args.threads)
    config = ModelConfig.from_dir(model_dir)
    helm = load_model(model_dir, Placement.from_split(config.num_units, config.num_units), config)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=config.dtype).eval()
    nbytes = weight_bytes_per_token(helm)
    prompt = [1000 + (i * 7919) % 50000 % (config.vocab_size - 1000)
              for i in range(max(args.prompts + args.depths + [128]))]
    print(f"\n== {model_dir}: {size} {dtype}, {nbytes / 1e9:.2f} GB of weights per decode token, "
          f"{args.threads} threads, HELM kernels {kernel_isa(helm)}, routes {helm.stages[0].ops.kernel_set.routes}")
    run_helm(helm, prompt[:8], 4)  # warm up both
    run_hf(hf, prompt[:8], 4)
    # HELM between its peers, the order flipping each run: every ratio is paired (the docstring)
    engines = (["llama.cpp"] if args.llama_cpp else []) + ["helm", "hf"]
    peers = [e for e in engines if e != "helm"]
    decode = {e: [] for e in engines}
    ttft = {(e, p): [] for e in engines for p in args.prompts}
    decode_at = {(e, d): [] for e in engines if e != "hf" for d in args.depths}
    paired = {}  # (measure, peer) → the peer's ratio to HELM in each run (> 1: HELM faster)
    read = []
    for r in range(args.runs):
        order = engines if r % 2 == 0 else engines[::-1]
        bw = read_gbps(args.threads)
        read.append(bw)
        got = {}
        for engine in order:
            if engine == "helm":
                t, tps = run_helm(helm, prompt[:128], args.new_tokens)
            elif engine == "hf":
                t, tps = run_hf(hf, prompt[:128], args.new_tokens)
            else:
                tps = run_llama_cpp(model_dir, dtype, 0, args.new_tokens, args.threads)["tg_tokens_per_s"]
            got[engine] = tps
            decode[engine].append(tps)
            print(f"  run {r + 1} decode {engine:>9}: {tps:6.2f} tok/s ({tps * nbytes / 1e9 / bw:.0%} of read "
                  f"{bw:.1f} GB/s) (load {os.getloadavg()[0]:.2f})", flush=True)
        for e in peers:
            paired.setdefault(("decode", e), []).append(got["helm"] / got[e])
        for p in args.prompts:
            got = {}
            for engine in order:
                if engine == "helm":
                    t, _ = run_helm(helm, prompt[:p], 1)
                elif engine == "hf":
                    if p > args.hf_max_prompt:
                        continue
                    t, _ = run_hf(hf, prompt[:p], 1)
                else:
                    t = run_llama_cpp(model_dir, dtype, p, 0, args.threads)["ttft_ms"]
                got[engine] = t
                ttft[engine, p].append(t)
                print(f"  run {r + 1} TTFT {p:>5} {engine:>9}: {t:8.0f} ms (load {os.getloadavg()[0]:.2f})", flush=True)
            for e in peers:
                if e in got:
                    paired.setdefault((f"ttft@{p}", e), []).append(got[e] / got["helm"])
        for d in args.depths:
            got = {}
            for engine in order:
                if engine == "helm":
                    _, tps = run_helm(helm, prompt[:d], args.new_tokens)
                elif engine == "llama.cpp":
                    tps = llama_cpp_at_depth(model_dir, dtype, d, args.new_tokens, args.threads)
                else:
                    continue  # transformers' prompt of d tokens: --hf-max-prompt's reason
                got[engine] = tps
                decode_at[engine, d].append(tps)
                print(f"  run {r + 1} decode at {d:>5} {engine:>9}: {tps:6.2f} tok/s (load {os.getloadavg()[0]:.2f})",
                      flush=True)
            if "llama.cpp" in got:
                paired.setdefault((f"decode@{d}", "llama.cpp"), []).append(got["helm"] / got["llama.cpp"])
    del hf, helm
    med_bw = _median(read)
    grown, budget = rss["peak"] - rss["baseline"], rss["weights"] + rss["kv"]
    return {"model": model_dir, "size": size, "dtype": dtype, "read_gbps": med_bw, "weight_bytes": nbytes,
            "decode": {e: _median(v) for e, v in decode.items()},
            "ttft": {f"{e}@{p}": _median(v) for (e, p), v in ttft.items()},
            "decode_at": {f"{e}@{d}": _median(v) for (e, d), v in decode_at.items()},
            "ratio": {f"{m}/{e}": {"median": _median(v), "min": min(v), "max": max(v)}
                      for (m, e), v in paired.items()},
            "rss_of_weights_kv": grown / budget, "rss_grown_mib": grown / 2**20, "weights_kv_mib": budget / 2**20}


def _paired(res: dict, measure: str, engine: str) -> str:
    """The median of the per-run ratios, with their range when there are several runs."""
    r = res["ratio"].get(f"{measure}/{engine}")
    if r is None:
        return f"{'-':>6} {'':>11}"
    spread = f"({r['min']:.2f}–{r['max']:.2f})" if r["max"] > r["min"] else ""
    return f"{r['median']:>5.2f}x {spread:>11}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="qwen3-0.6b", help="model presets, comma-separated (built if missing)")
    parser.add_argument("--dtypes", default="bf16", help="weight dtypes: bf16, fp16, comma-separated")
    parser.add_argument("--prompts", default="128", help="prompt lengths for TTFT, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode tokens after a 128-token prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="alternating runs of each engine")
    parser.add_argument("--llama-cpp", action="store_true", help=f"also run llama.cpp ({LLAMA_CPP})")
    parser.add_argument("--depths", default="", help="also decode with this many tokens already cached, "
                        "comma-separated (HELM and llama.cpp)")
    parser.add_argument("--hf-max-prompt", type=int, default=512, help="longest prompt run through transformers")
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args(argv)
    args.prompts = sorted(int(p) for p in args.prompts.split(","))
    args.depths = sorted(int(d) for d in args.depths.split(",") if d)
    torch.set_num_threads(args.threads)
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    results = [bench_model(args, size, dtype) for size in args.sizes.split(",") for dtype in args.dtypes.split(",")]

    engines = (["llama.cpp"] if args.llama_cpp else []) + ["hf"]
    print(f"\nmedians over {args.runs} runs ({args.threads} threads); each ratio is the median of the runs' own "
          f"ratios, HELM against the peer measured next to it in the same run, with their range: the peer's "
          f"time over HELM's for TTFT, HELM's tok/s over the peer's for decode; > 1 means HELM is faster")
    head = f"{'model':<24} {'measure':<13} {'HELM':>9} " + " ".join(f"{e:>10} {'ratio':>6} {'(range)':>11}"
                                                               for e in engines)
    print(head)
    for res in results:
        name = f"{res['size']} {res['dtype']}"
        for p in args.prompts:
            h = res["ttft"][f"helm@{p}"]
            times = {e: res["ttft"][f"{e}@{p}"] for e in engines}  # NaN: not run at this length
            cells = " ".join((f"{times[e]:>10.0f}" if times[e] == times[e] else f"{'-':>10}") + " "
                             + _paired(res, f"ttft@{p}", e) for e in engines)
            print(f"{name:<24} {f'TTFT {p} ms':<13} {h:>9.0f} {cells}")
        h = res["decode"]["helm"]
        cells = " ".join(f"{res['decode'][e]:>10.2f} {_paired(res, 'decode', e)}" for e in engines)
        print(f"{name:<24} {'decode tok/s':<13} {h:>9.2f} {cells}   "
              f"({h * res['weight_bytes'] / 1e9 / res['read_gbps']:.0%} of read; peak RSS +"
              f"{res['rss_grown_mib']:.0f} MiB = {res['rss_of_weights_kv']:.1%} of weights + KV)")
        for d in args.depths:
            h = res["decode_at"][f"helm@{d}"]
            cells = " ".join((f"{res['decode_at'][f'{e}@{d}']:>10.2f} {_paired(res, f'decode@{d}', e)}"
                              if f"{e}@{d}" in res["decode_at"] else f"{'-':>10} {_paired(res, '', e)}")
                             for e in engines)
            print(f"{name:<24} {f'tok/s @{d}':<13} {h:>9.2f} {cells}")
    if args.json:
        import json
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
