"""Benchmark: peak host memory (RSS) while loading a checkpoint onto a CPU/GPU split.

Weights stream tensor by tensor from memory-mapped safetensors to the stage that owns them, so
peak RSS should be ≈ the CPU stages' weights + one tensor + the Python/torch baseline, never the
whole model. Each split loads in a fresh process so peaks don't mix.

    python tools/bench_load.py --model models/qwen3-0.6b [--splits 0,15,30]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.loader import load_model

def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

model_dir, split = sys.argv[1], int(sys.argv[2])
config = ModelConfig.from_dir(model_dir)
baseline = rss_mib()
t0 = time.perf_counter()
model = load_model(model_dir, Placement.from_split(config.num_units, split), config)
load_s = time.perf_counter() - t0
cpu_bytes = 0
seen = set()
for stage in model.stages:
    if stage.device.type != "cpu":
        continue
    for t in [stage.embedding] + [getattr(l, "weight", None) for b in stage.blocks for l in (b.qkv, b.o, b.gate_up, b.down)] \
            + ([stage.head.lm_head.weight] if stage.head else []):
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            cpu_bytes += t.numel() * t.element_size()
print(json.dumps({"split": split, "baseline_mib": baseline, "peak_mib": rss_mib(), "load_s": load_s,
                  "cpu_weights_mib": cpu_bytes / 2**20, "stages": [repr(s) for s in model.stages]}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--splits", help="comma-separated splits (default: 0, middle, all)")
    args = parser.parse_args()
    config = json.loads((Path(args.model) / "config.json").read_text())
    units = config["num_hidden_layers"] + 2
    splits = [int(s) for s in args.splits.split(",")] if args.splits else [0, units // 2, units]
    total = sum(p.stat().st_size for p in Path(args.model).glob("*.safetensors")) / 2**20
    print(f"model {args.model}: {units} units, {total:.0f} MiB of safetensors")
    print(f"{'split':>5} {'cpu weights MiB':>16} {'baseline MiB':>13} {'peak RSS MiB':>13} "
          f"{'peak - baseline':>16} {'overhead':>9} {'load s':>7}")
    for split in splits:
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(split)], capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        grown = r["peak_mib"] - r["baseline_mib"]
        over = grown - r["cpu_weights_mib"]
        print(f"{split:>5} {r['cpu_weights_mib']:>16.0f} {r['baseline_mib']:>13.0f} {r['peak_mib']:>13.0f} "
              f"{grown:>16.0f} {over:>+8.0f}M {r['load_s']:>7.2f}")
    print("peak - baseline should be ≈ cpu weights (+ one tensor); a GPU stage on a machine without CUDA "
          "runs on the CPU too, so without CUDA every split holds the whole model in host RAM.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
