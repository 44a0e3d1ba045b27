"""Soak test of the daemon (a benchmark, not a test): does its memory stay flat over hundreds of
requests when clients cancel, miss deadlines and disconnect?

    python tools/soak.py --plan models/qwen3-0.6b.plan.yaml [--requests 500] [--clients 8]
                         [--warmup 50] [--prompt-tokens 16] [--max-new-tokens 16] [--json out.json]

Starts `helm-executor serve --plan PLAN --port 0` itself (it reads the daemon's RSS from /proc),
sends --warmup requests, takes the RSS as the baseline, then sends --requests more from --clients
concurrent clients, rotating four kinds: read to the end, cancel after a few tokens, a deadline
that expires mid-stream, and a client that closes its channel mid-stream. It prints the RSS
every 50 requests and at the end, once the daemon is idle, with the growth over the baseline;
it exits 1 when the end RSS is more than --max-growth (default 10%) above the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: python tools/soak.py
    sys.path.insert(0, str(REPO))

from tools.daemon_process import DaemonProcess  # noqa: E402

KINDS = ("complete", "cancel", "deadline", "disconnect")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def one_request(addr: str, client, pb, kind: str, prompt: list[int], new_tokens: int, rng: random.Random) -> str:
    """Send one request of `kind`; the outcome ('ok', 'cancelled', 'deadline', 'disconnected', or an error code)."""
    import grpc

    from executor.server.client import ExecutorClient

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
    stop_after = rng.randrange(1, max(2, new_tokens // 2))
    try:
        if kind == "disconnect":
            with ExecutorClient(addr) as own:  # its own channel, closed mid-stream
                stream = own.stub.Generate(request, timeout=600)
                for i, _ in enumerate(stream):
                    if i + 1 >= stop_after:
                        break
            return "disconnected"
        if kind == "deadline":
            list(client.stub.Generate(request, timeout=0.05 + rng.random() * 0.2))
            return "ok"  # finished within the deadline
        stream = client.stub.Generate(request, timeout=600)
        for i, _ in enumerate(stream):
            if kind == "cancel" and i + 1 >= stop_after:
                stream.cancel()
                return "cancelled"
        return "ok"
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "deadline"
        if e.code() == grpc.StatusCode.CANCELLED:
            return "cancelled"
        return e.code().name


def run(addr: str, pid: int, count: int, clients: int, prompt_tokens: int, new_tokens: int, vocab: int,
        seed: int, samples: list | None) -> dict[str, int]:
    from executor.pb import executor_pb2 as pb
    from executor.server.client import ExecutorClient

    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    next_index = iter(range(count))

    def worker(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        with ExecutorClient(addr) as client:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                prompt = [rng.randrange(10, vocab) for _ in range(prompt_tokens)]
                outcome = one_request(addr, client, pb, KINDS[i % len(KINDS)], prompt, new_tokens, rng)
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    done = sum(outcomes.values())
                if samples is not None and done % 50 == 0:
                    samples.append((done, rss_bytes(pid)))
                    print(f"  {done:>5} requests: RSS {samples[-1][1] / 2**20:.1f} MiB", file=sys.stderr)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def wait_idle(client, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        q = client.info().queue
        if q.waiting + q.running == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the daemon did not become idle")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", required=True, help="plan YAML to serve (its model.source is the checkpoint)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50, help="requests before the baseline RSS")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, help="the daemon's CPU threads (default: the plan's)")
    parser.add_argument("--max-growth", type=float, default=0.10, help="allowed end RSS growth over the baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.requests, args.warmup, args.clients, args.prompt_tokens, args.max_new_tokens) < 1:
        parser.error("--requests, --warmup, --clients, --prompt-tokens and --max-new-tokens must be >= 1")

    from executor.server.client import ExecutorClient

    log_path = Path(tempfile.mkdtemp(prefix="helm-soak-")) / "daemon.log"
    daemon = DaemonProcess(["--plan", args.plan, "--max-batch", str(args.clients), "--max-queue", str(args.clients),
                            *(["--threads", str(args.threads)] if args.threads else [])], log_path, 600)
    proc, addr = daemon.proc, daemon.addr
    try:
        with ExecutorClient(addr) as client:
            client.wait_serving(timeout_s=600)
            info = client.info()
            vocab = info.model.vocab_size
            print(f"daemon {addr} (pid {proc.pid}): {info.model.architecture} {info.model.dtype}, plan k="
                  f"{info.plan.split_k}, kernels {info.kernel_isa}; logs {log_path}", file=sys.stderr)
            started = rss_bytes(proc.pid)
            t0 = time.perf_counter()
            run(addr, proc.pid, args.warmup, args.clients, args.prompt_tokens, args.max_new_tokens, vocab,
                args.seed + 1, None)
            wait_idle(client)
            baseline = rss_bytes(proc.pid)
            samples: list = []
            outcomes = run(addr, proc.pid, args.requests, args.clients, args.prompt_tokens, args.max_new_tokens,
                           vocab, args.seed, samples)
            wait_idle(client)
            time.sleep(1.0)  # the daemon's pages of the last cancellations come back
            end = rss_bytes(proc.pid)
            wall_s = time.perf_counter() - t0
            kv_left = sum(s.kv.sequences for s in client.info().stages if s.HasField("kv"))
    finally:
        daemon.stop(60)
    cancelled_logged = sum(1 for line in log_path.read_text().splitlines() if '"request cancelled"' in line)
    peak = max([baseline, end] + [rss for _, rss in samples])
    growth = end / baseline - 1
    print(f"{args.requests} requests after {args.warmup} warm-up, {args.clients} clients, "
          f"{args.prompt_tokens} prompt + {args.max_new_tokens} new tokens, kinds rotating {', '.join(KINDS)}")
    print(f"outcomes: {', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))}; "
          f"'request cancelled' log lines: {cancelled_logged}; sequences holding KV at the end: {kv_left}")
    print(f"RSS MiB: at start {started / 2**20:.1f}, baseline after warm-up {baseline / 2**20:.1f}, "
          f"peak {peak / 2**20:.1f}, end {end / 2**20:.1f}; end vs baseline {growth * 100:+.1f}% "
          f"(limit {args.max_growth * 100:.0f}%): {'OK' if growth <= args.max_growth else 'GREW'}; {wall_s:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "requests": args.requests, "warmup": args.warmup, "clients": args.clients, "outcomes": outcomes,
            "rss_start": started, "rss_baseline": baseline, "rss_peak": peak, "rss_end": end, "growth": growth,
            "samples": samples, "kv_sequences_left": kv_left, "cancelled_log_lines": cancelled_logged,
            "cpu": os.cpu_count()}, indent=2))
    return 0 if growth <= args.max_growth and kv_left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
