"""What the host adds to every decode step of a GPU stage: the engine's step with the device's work
taken out, so what is left is the Python and bookkeeping a GPU must wait for between steps.

    python tools/bench_host_step.py --model models/qwen3-0.6b
    python tools/bench_host_step.py --model models/qwen3-0.6b --steps 400

The model's units after the embedding form a GPU stage (on the CPU where there is no CUDA, the
way the tests run it) whose static decode step (executor/device_step.py) and output projection
return at once; the engine, the stage's bookkeeping, the step's index, sampling and (optionally)
the Recorder's prediction still run. Each setting decodes --steps tokens after a 64-token prompt,
so every step's context is new to the Recorder's cache, as in a single request. On a fast GPU a
decode step takes a few milliseconds, so these figures are a share of it no graph can hide, but
for the part the engine runs once the step's device work is queued (Engine.on_launched: the
Recorder's prediction), which a GPU stage's computing hides; the last column times it apart.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from executor.device_step import ResidentDecode  # noqa: E402
from executor.engine import Engine  # noqa: E402
from executor.loader import load_model  # noqa: E402
from executor.model_config import ModelConfig  # noqa: E402
from executor.plan_io import placement_for  # noqa: E402
from executor.report import Recorder, kernel_isa  # noqa: E402
from executor.request_params import SamplingParams, StopCriteria  # noqa: E402
from planner.planning import plan_for_split, workload_for  # noqa: E402
from planner.profile import placeholder_machine  # noqa: E402

SETTINGS = {"greedy": SamplingParams(), "Qwen3's sampling": SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=0),
            "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=0)}
PROMPT = 64


def host_step_ms(model_dir: Path, steps: int) -> list[dict]:
    config = ModelConfig.from_dir(model_dir)
    plan = plan_for_split(model_dir, 1, placeholder_machine(), page_size_tokens=64,
                          workload=workload_for(PROMPT, steps + 1))
    model = load_model(model_dir, placement_for(plan, config), config, backend="torch", kv_slab=True)
    gpu = model.stages[-1]
    if not isinstance(gpu.fused, ResidentDecode):
        raise SystemExit("the GPU stage has no static decode step to stub out")
    logits = torch.randn(1, config.vocab_size, generator=torch.Generator().manual_seed(0)).to(gpu.device)
    gpu.fused.graphs = False                    # on CUDA: the step itself, not its captured graph,
    gpu.fused.step = lambda x, index: x         # whose device work is gone
    gpu.head.lm_head = lambda x: logits.expand(x.shape[0], -1)            # and the output projection's
    engine = Engine(model, eos_token_ids=(), prefix_cache=False)  # every request prefills its prompt
    rows = []
    for name, params in SETTINGS.items():
        for recorded in (False, True):
            recorder = Recorder(plan, "bench_host_step", config.architecture, kernel_isa(model),
                                stream_prefill=model.stream_prefill) if recorded else None
            engine.on_step = engine.on_launched = None
            launched = [0.0]  # seconds in Engine.on_launched: host work a GPU stage's computing hides
            if recorder is not None:
                recorder.attach(engine)
                engine.on_launched = functools.partial(_timed, recorder.prepare, launched)
            engine.add_request(list(range(10, 10 + PROMPT)), params,
                               StopCriteria(max_new_tokens=steps + 1, ignore_eos=True))
            engine.step()  # the prompt
            start, n, launched[0] = time.perf_counter(), 0, 0.0
            while engine.has_work():
                engine.step()
                n += 1
            rows.append({"sampling": name, "recorder": recorded, "steps": n,
                         "host_ms_per_step": round(1e3 * (time.perf_counter() - start) / n, 3),
                         "while_gpu_computes_ms": round(1e3 * launched[0] / n, 3)})
    return rows


def _timed(hook, total: list[float], step) -> None:
    t0 = time.perf_counter()
    hook(step)
    total[0] += time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint directory (tools/make_model.py)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; host ms per decode step, the device's work "
          f"stubbed out, {args.steps} steps after a {PROMPT}-token prompt")
    print("| sampling | Recorder | host ms a step | of which while the GPU computes |")
    print("|---|---|---:|---:|")
    for row in host_step_ms(Path(args.model), args.steps):
        print(f"| {row['sampling']} | {'yes' if row['recorder'] else 'no'} | {row['host_ms_per_step']} | "
              f"{row['while_gpu_computes_ms']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
