"""GEMV bandwidth of HELM's CPU kernels on the projection shapes of real models, next to the
machine's DRAM read bandwidth measured in the same run and to PyTorch's F.linear on the same
shape.

Every weight is cycled through a pool of copies of at least --pool-gib so that each call streams
from DRAM, not from the (large) L3. For every row the three measurements alternate, --repeats
times: read probe (KernelSet.read_pass: every thread reads its share as 4 sequential streams with
prefetch, over --read-gib), our `linear`, PyTorch's F.linear on the weight in its own dtype (x
cast to it, as a bf16/fp16 model runs). The table shows the median GB/s (weight bytes / time),
the min–max spread, and the ratios of the medians.

The machine may be shared: a triple of samples during which other processes kept more than
--max-foreign-cpu cores busy (from /proc/stat) is measured again, up to --retries times; the
`redo` column counts those; a row still measured under load is marked `!` and left out of the
summary. Check `uptime` before a run that matters, and repeat it.

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
from dataclasses import asdict, dataclass, field
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


class ForeignLoad:
    """CPU time used by other processes while a measurement ran, in cores (Linux /proc)."""

    HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:9]]
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return busy, int(own[11]) + int(own[12])  # utime + stime of all our threads

    def __enter__(self):
        self.t0, (self.b0, self.o0) = time.perf_counter(), self._ticks()
        return self

    def __exit__(self, *exc):
        b1, o1 = self._ticks()
        self.cores = ((b1 - self.b0) - (o1 - self.o0)) / self.HZ / (time.perf_counter() - self.t0)
        return False


@dataclass
class Row:
    model: str
    proj: str
    n: int
    k: int
    dtype: str
    batch: int
    path: str  # what K.linear ran: "gemv" (the default KernelSet keeps every batch in our GEMV)
    weight_mib: float
    read_gbps: list[float] = field(default_factory=list)
    ours_gbps: list[float] = field(default_factory=list)
    torch_gbps: list[float] = field(default_factory=list)
    loaded: list[bool] = field(default_factory=list)  # per sample: others stayed busy throughout
    redone: int = 0  # samples measured again because other processes were busy

    def kept(self, v: list[float]) -> list[float]:
        """The samples taken without foreign load, or all of them if there are none such."""
        clean = [s for s, bad in zip(v, self.loaded) if not bad]
        return clean or v

    def med(self, v: list[float]) -> float:
        v = self.kept(v)
        return statistics.median(v) if v else float("nan")


def read_gbps(buf: torch.Tensor, threads: int) -> float:
    t0 = time.perf_counter()
    K.default_set.read_pass(buf, num_threads=threads)
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

    path = K.default_set.path(dtype, batch)
    row = Row(model, proj, n, k, dtype_name, batch, path, nbytes / 2**20)
    pool_gbps(ours, prepared, nbytes)  # warm-up: page in, settle clocks
    if not args.no_torch:
        pool_gbps(torch_linear, weights[:4], nbytes)
    for _ in range(args.repeats):
        for attempt in range(args.retries + 1):
            with ForeignLoad() as load:
                sample = (read_gbps(read_buf, args.threads), pool_gbps(ours, prepared, nbytes),
                          None if args.no_torch else pool_gbps(torch_linear, weights, nbytes))
            if load.cores <= args.max_foreign_cpu or attempt == args.retries:
                break
            row.redone += 1
            time.sleep(1.0)
        row.loaded.append(load.cores > args.max_foreign_cpu)
        row.read_gbps.append(sample[0])
        row.ours_gbps.append(sample[1])
        if sample[2] is not None:
            row.torch_gbps.append(sample[2])
    return row


def fmt_spread(r: Row, v: list[float]) -> str:
    v = r.kept(v)
    if not v:
        return "-"
    return f"{statistics.median(v):5.1f} ({min(v):.1f}–{max(v):.1f})"


HEADER = (f"{'model':<11} {'proj':<8} {'N×K':>13} {'dtype':<5} {'B':>3} {'MiB':>7}  "
          f"{'read GB/s':>19}  {'ours GB/s':>19}  {'torch GB/s':>19}  "
          f"{'ours/read':>9} {'ours/torch':>10} {'redo':>4}")

CLEAN_SAMPLES = 3  # a row counts in the summary when at least this many samples ran unloaded


def format_row(r: Row) -> str:
    rd, us, th = r.med(r.read_gbps), r.med(r.ours_gbps), r.med(r.torch_gbps)
    ours = fmt_spread(r, r.ours_gbps) + ("*" if r.path != "gemv" else "")
    return (f"{r.model:<11} {r.proj:<8} {f'{r.n}×{r.k}':>13} {r.dtype:<5} {r.batch:>3} "
            f"{r.weight_mib:7.1f}  {fmt_spread(r, r.read_gbps):>19}  {ours:>19}  "
            f"{fmt_spread(r, r.torch_gbps):>19}  {us / rd:9.0%} {us / th:10.2f} {r.redone:4d}"
            + ("" if clean(r) else " !"))


def clean(r: Row) -> bool:
    return r.loaded.count(False) >= min(CLEAN_SAMPLES, len(r.loaded))


def summary(rows: list[Row]) -> list[str]:
    lines = []
    for dtype in dict.fromkeys(r.dtype for r in rows):
        for batch in dict.fromkeys(r.batch for r in rows):
            every = [r for r in rows if r.dtype == dtype and r.batch == batch]
            sel = [r for r in every if clean(r)]
            if not sel:
                lines.append(f"# {dtype} B={batch}: no row measured without foreign load")
                continue
            ratio = [r.med(r.ours_gbps) / r.med(r.read_gbps) for r in sel]
            vs_torch = [r.med(r.ours_gbps) / r.med(r.torch_gbps) for r in sel if r.torch_gbps]
            line = (f"# {dtype} B={batch}: ours/read min {min(ratio):.0%}, median "
                    f"{statistics.median(ratio):.0%}, max {max(ratio):.0%} over {len(sel)} shapes"
                    + (f" ({len(every) - len(sel)} loaded rows left out)" if len(every) > len(sel) else ""))
            if vs_torch:
                line += f"; ours/torch median {statistics.median(vs_torch):.2f}"
            lines.append(line)
    return lines


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
    p.add_argument("--max-foreign-cpu", type=float, default=0.2,
                   help="redo a sample while other processes used more cores than this")
    p.add_argument("--retries", type=int, default=3, help="redos per sample at most")
    p.add_argument("--json", type=Path, help="also write every sample here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    read_buf = torch.ones(int(args.read_gib * GIB) // 8, dtype=torch.int64)
    print(f"# kernels: ISA {K.KERNEL_ISA} (available: {', '.join(K.available_isas())}), "
          f"threads {args.threads}, prefetch bf16/fp16/fp32 "
          f"{'/'.join(str(K._kernels.prefetch_bytes(d)) for d in DTYPES.values())} B; torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads); pool {args.pool_gib} GiB, "
          f"read probe {args.read_gib} GiB; load avg {os.getloadavg()[0]:.2f}")
    print(f"# GB/s: median (min–max) of {args.repeats} samples, those under foreign load left out "
          f"where others exist; * = this batch left our GEMV (a GEMM route); "
          f"! = fewer than {CLEAN_SAMPLES} unloaded samples")
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
    for line in summary(rows):
        print(line)
    print(f"# load avg at end {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"isa": K.KERNEL_ISA, "threads": args.threads,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
