"""Load test of a running daemon (a benchmark, not a test): aggregate tokens/s and per-token
latency at 1, 4 and 16 concurrent clients, and the gain of batching over sequential requests
(the 1-client level: each client sends its requests one after another).

    helm-executor serve --plan models/qwen3-0.6b.plan.yaml &
    python tools/load_test.py --addr 127.0.0.1:50051 [--clients 1,4,16] [--requests-per-client 2]
                              [--prompt-tokens 32] [--max-new-tokens 32] [--json out.json]

Every request sends a different random prompt of --prompt-tokens ids and generates exactly
--max-new-tokens tokens (EOS ignored), greedily. Per-token latency is the gap between two
consecutive tokens of one stream as the client receives them; TTFT is measured at the client.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass


@dataclass
class Level:
    clients: int
    requests: int
    failed: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    gain_vs_sequential: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    token_p50_ms: float
    token_p99_ms: float
    errors: list[str]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_level(client, pb, clients: int, per_client: int, prompt_tokens: int, new_tokens: int,
              vocab: int, seed: int, timeout_s: float) -> Level:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(clients * per_client)]
    ttfts, gaps, errors = [], [], []
    tokens = 0
    lock = threading.Lock()

    def one_client(c: int) -> None:
        nonlocal tokens
        for r in range(per_client):
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[c * per_client + r]),
                                         stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
            start = last = time.perf_counter()
            my_gaps, first, n = [], None, 0
            try:
                for msg in client.stub.Generate(request, timeout=timeout_s):
                    if msg.HasField("token"):
                        now = time.perf_counter()
                        if first is None:
                            first = now - start
                        else:
                            my_gaps.append(now - last)
                        last, n = now, n + 1
            except Exception as e:  # noqa: BLE001 — count it, keep loading
                with lock:
                    code = e.code() if hasattr(e, "code") else ""
                    errors.append(f"{code}: {e.details() if hasattr(e, 'details') else e}")
                continue
            with lock:
                tokens += n
                ttfts.append(first if first is not None else float("nan"))
                gaps.extend(my_gaps)

    threads = [threading.Thread(target=one_client, args=(c,), daemon=True) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return Level(clients, clients * per_client, len(errors), tokens, wall, tokens / wall if wall else 0.0, 1.0,
                 percentile(ttfts, 0.5) * 1e3, percentile(ttfts, 0.99) * 1e3,
                 percentile(gaps, 0.5) * 1e3, percentile(gaps, 0.99) * 1e3, errors[:5])


def main(argv: list[str] | None = None) -> int:
    from executor.server.auth import ClientAuth

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT of the daemon")
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels, comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="deadline per request, seconds")
    parser.add_argument("--json", help="also write the results as JSON here")
    ClientAuth.add_args(parser)
    args = parser.parse_args(argv)

    from executor.pb import executor_pb2 as pb
    from executor.server.client import ExecutorClient

    levels = [int(c) for c in args.clients.split(",")]
    with ExecutorClient(args.addr, ClientAuth.from_args(args)) as client:
        client.wait_serving(timeout_s=60)
        info = client.info()
        vocab = info.model.vocab_size
        print(f"daemon {args.addr}: {info.model.architecture} ({info.model.directory}), plan v{info.plan.version} "
              f"{info.plan.digest[:15]}… k={info.plan.split_k}, kernels {info.kernel_isa}, "
              f"max batch {info.queue.max_batch}", file=sys.stderr)
        run_level(client, pb, 1, 1, args.prompt_tokens, 4, vocab, args.seed + 999, args.timeout)  # warm-up
        results = []
        for i, clients in enumerate(levels):
            level = run_level(client, pb, clients, args.requests_per_client, args.prompt_tokens,
                              args.max_new_tokens, vocab, args.seed + i, args.timeout)
            results.append(level)
            print(f"  {clients} client(s): {level.tokens} tokens in {level.wall_s:.1f} s", file=sys.stderr)
    base = next((r.tokens_per_s for r in results if r.clients == 1), results[0].tokens_per_s)
    for r in results:
        r.gain_vs_sequential = r.tokens_per_s / base if base else float("nan")

    print(f"{args.prompt_tokens} prompt tokens, {args.max_new_tokens} new tokens, "
          f"{args.requests_per_client} requests per client")
    print(f"{'clients':>7} {'requests':>8} {'failed':>6} {'tokens':>7} {'wall s':>7} {'tokens/s':>9} {'gain':>6} "
          f"{'TTFT p50 ms':>11} {'p99':>8} {'token p50 ms':>12} {'p99':>8}")
    for r in results:
        print(f"{r.clients:>7} {r.requests:>8} {r.failed:>6} {r.tokens:>7} {r.wall_s:>7.1f} {r.tokens_per_s:>9.2f} "
              f"{r.gain_vs_sequential:>5.2f}x {r.ttft_p50_ms:>11.1f} {r.ttft_p99_ms:>8.1f} {r.token_p50_ms:>12.1f} "
              f"{r.token_p99_ms:>8.1f}")
        for e in r.errors:
            print(f"        error: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"addr": args.addr, "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
                       "requests_per_client": args.requests_per_client, "levels": [asdict(r) for r in results]}, f,
                      indent=1)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
