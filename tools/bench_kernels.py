"""GEMV bandwidth of HELM's CPU kernels on the projection shapes of real models, next to the
machine's DRAM read bandwidth measured in the same run and to PyTorch's F.linear on the same
shape.

Every weight is cycled through a pool of copies of at least --pool-gib so that each call streams
from DRAM, not from the (large) L3. For every row the three measurements alternate, --repeats
times: read probe, our kernel, PyTorch; the table shows the median GB/s (weight bytes / time) and
the min–max spread, and the ratios of the medians.

    python tools/bench_kernels.py                              # Qwen3 0.6B/1.7B/8B, bf16/fp16/fp32
    python tools/bench_kernels.py --models qwen3-8b --dtypes bf16 --batches 1,8 --threads 2
    HELM_KERNEL_ISA=avx2 python tools/bench_kernels.py         # another variant
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import executor.kernels as K  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GIB = 1 << 30


def projection_shapes(config: dict, fused: bool) -> list[tuple[str, int, int]]:
    """(name, N, K) of every distinct projection of one decoder block, plus the output head."""
    h = config["hidden_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * d
    kv_dim = config["num_key_value_heads"] * d
    inter = config["intermediate_size"]
    shapes = [("q", q_dim, h), ("k/v", kv_dim, h), ("o", h, q_dim), ("gate/up", inter, h),
              ("down", h, inter)]
    if fused:  # as the executor runs them: q/k/v and gate/up each one matrix
        shapes += [("qkv", q_dim + 2 * kv_dim, h), ("gate_up", 2 * inter, h)]
    shapes.append(("lm_head", config["vocab_size"], h))
    return shapes


@dataclass
class Row:
    model: str
    proj: str
    n: int
    k: int
    dtype: str
    batch: int
    weight_mib: float
    read_gbps: list[float]
    ours_gbps: list[float]
    torch_gbps: list[float]

    @staticmethod
    def med(v: list[float]) -> float:
        return statistics.median(v) if v else float("nan")


def read_gbps(buf: torch.Tensor, threads: int) -> float:
    t0 = time.perf_counter()
    K.kernels.read_pass(buf, num_threads=threads)
    return buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9


def pool_gbps(fn, pool: list, nbytes: int) -> float:
    t0 = time.perf_counter()
    for item in pool:
        fn(item)
    return nbytes * len(pool) / (time.perf_counter() - t0) / 1e9


def bench_row(model, proj, n, k, dtype_name, batch, args, read_buf) -> Row:
    dtype = DTYPES[dtype_name]
    src = torch.randn(n, k).to(dtype)
    nbytes = src.numel() * src.element_size()
    copies = max(1, -(-int(args.pool_gib * GIB) // nbytes))
    weights = [src] + [src.clone() for _ in range(copies - 1)]
    prepared = [K.prepare_linear(w) for w in weights]
    x = torch.randn(batch, k)
    out = torch.empty(batch, n)
    x_t = x.to(dtype)

    def ours(w):
        K.linear(x, w, out=out, num_threads=args.threads)

    def torch_linear(w):
        F.linear(x_t, w)

    pool_gbps(ours, prepared, nbytes)  # warm-up: page in, settle clocks
    row = Row(model, proj, n, k, dtype_name, batch, nbytes / 2**20, [], [], [])
    for _ in range(args.repeats):
        row.read_gbps.append(read_gbps(read_buf, args.threads))
        row.ours_gbps.append(pool_gbps(ours, prepared, nbytes))
        if not args.no_torch:
            row.torch_gbps.append(pool_gbps(torch_linear, weights, nbytes))
    return row


def fmt_spread(v: list[float]) -> str:
    if not v:
        return "-"
    return f"{Row.med(v):6.1f} ({min(v):.1f}–{max(v):.1f})"


HEADER = (f"{'model':<11} {'proj':<8} {'N×K':>13} {'dtype':<5} {'B':>3} {'MiB':>7}  "
          f"{'read GB/s (min–max)':>21}  {'ours GB/s (min–max)':>21}  {'torch GB/s (min–max)':>21}"
          f"  {'ours/read':>9} {'ours/torch':>10}")


def format_row(r: Row) -> str:
    rd, us, th = Row.med(r.read_gbps), Row.med(r.ours_gbps), Row.med(r.torch_gbps)
    return (f"{r.model:<11} {r.proj:<8} {f'{r.n}×{r.k}':>13} {r.dtype:<5} {r.batch:>3} "
            f"{r.weight_mib:7.1f}  {fmt_spread(r.read_gbps):>21}  {fmt_spread(r.ours_gbps):>21}  "
            f"{fmt_spread(r.torch_gbps):>21}  {us / rd:9.0%} {us / th:10.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b,qwen3-8b",
                   help="comma-separated names of tools/model_configs/*.json")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated: bf16,fp16,fp32")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes (rows of x)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for our kernels, the read probe and PyTorch (default: all cores)")
    p.add_argument("--repeats", type=int, default=5, help="alternating measurements per row")
    p.add_argument("--pool-gib", type=float, default=1.0,
                   help="bytes of weight copies cycled per measurement (keep >> L3)")
    p.add_argument("--read-gib", type=float, default=2.0, help="size of the read-probe buffer")
    p.add_argument("--fused", action="store_true", help="also the executor's fused qkv and gate_up")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch's F.linear")
    p.add_argument("--json", type=Path, help="also write every sample here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    read_buf = torch.ones(int(args.read_gib * GIB) // 8, dtype=torch.int64)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# kernels: ISA {K.KERNEL_ISA} (available: {', '.join(K.available_isas())}), "
          f"threads {args.threads}, prefetch {K._kernels.prefetch_bytes()} B; torch {torch.__version__}; "
          f"pool {args.pool_gib} GiB, read probe {args.read_gib} GiB; load avg {load:.2f}")
    print(HEADER)
    print("-" * len(HEADER))
    rows: list[Row] = []
    for model in args.models.split(","):
        config = json.loads((CONFIG_DIR / f"{model}.json").read_text())
        for proj, n, k in projection_shapes(config, args.fused):
            for dtype_name in args.dtypes.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    rows.append(bench_row(model, proj, n, k, dtype_name, batch, args, read_buf))
                    print(format_row(rows[-1]), flush=True)
    ours_read = [Row.med(r.ours_gbps) / Row.med(r.read_gbps) for r in rows]
    print(f"# ours/read: min {min(ours_read):.0%}, median {statistics.median(ours_read):.0%}, "
          f"max {max(ours_read):.0%} over {len(rows)} rows")
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# load avg at end {load_end:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"isa": K.KERNEL_ISA, "threads": args.threads,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
