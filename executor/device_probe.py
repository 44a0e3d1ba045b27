"""What the GPU stage achieves on this device, measured with the executor's own code: the rates
`helm-plan profile` prices a GPU stage with (planner/profile.py, measure_gpu).

- `device_gemv_gibps`: the rate at which a decode step's projections stream their weights.
- `decode_block_ms`: what one more decoder block adds to the GPU stage's decode step, run as the
  engine runs it (Stage.forward → the static step, replayed as a CUDA graph unless
  HELM_CUDA_GRAPHS=0, compiled where HELM_COMPILE=1: whatever this process's environment makes
  the executor do). On a fast GPU that step is bound by its kernels, not by HBM; the profile
  prices the difference as the per-block overhead δ.

Timers are passed in (CUDA events on the GPU), so the CPU tests run the same code on CPU tensors.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

from executor.batch import StepBatch
from executor.backends import TorchBackend
from executor.kv_cache import KVCache
from executor.model_config import ModelConfig
from executor.stage import BlockWeights, Stage
from planner.units import GIB

Timer = Callable[[Callable[[], object], int], float]  # (fn, calls) -> seconds per call

#: The decoder block the profile times: Qwen3-8B's (hidden 4096, MLP 12288, 32 query and 8 KV
#: heads of 128, q/k norm: the family whose block launches the most kernels), as a config.json
#: of one layer, which the planner traces for the block's roofline.
DECODE_BLOCK_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_hidden_layers": 1, "vocab_size": 151936, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "torch_dtype": "bfloat16",
}
#: The token decoded sits at this context (the issue's all-GPU target) in pages of PAGE tokens.
DECODE_BLOCK_CONTEXT, DECODE_BLOCK_PAGE = 1024, 512
#: The two stage depths whose difference is timed: one block's weights serve every layer (its
#: bytes dwarf any GPU's L2 at real widths, so each layer still reads them from HBM), and the
#: shallower stage is deep enough that the GPU, not the host's per-step work (which the difference
#: assumes it hides), sets its pace: eight blocks' weights take longer to read than a step's host
#: work takes, even at 8 TB/s.
DECODE_BLOCK_LAYERS = (8, 16)


def device_gemv_gibps(device, hidden: int, dtype: torch.dtype, timer: Timer, reps: int, copies: int = 4) -> float:
    """GiB/s at which the GPU stage's projections stream their weights in a decode step: the
    one-token matmul executor.torch_ops.TorchLinear issues on CUDA (its activation already cast
    to the weights' half precision; the casts are launches of their own, which δ prices), over
    (3·H, H) weights in `dtype`, `copies` of them in turn so that none is still in the GPU's L2
    cache when it is read again. A device copy's bandwidth (the profile's HBM figure) overstates
    what a matrix-vector product reaches. One launch per call, so the GPU's queue stays ahead of
    the host on a fast GPU. timer: seconds per call (CUDA events)."""
    linears = [torch.randn(3 * hidden, hidden, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    turn = iter(range(1 << 62))

    def one():
        return torch.nn.functional.linear(x, linears[next(turn) % copies])

    one()
    nbytes = linears[0].numel() * linears[0].element_size()
    return max(nbytes / timer(one, reps) for _ in range(3)) / GIB


def _block(config: ModelConfig, device, ops: TorchBackend) -> BlockWeights:
    """One block of random weights, scaled so the hidden state stays finite however deep the stage."""
    gen = torch.Generator(device=device).manual_seed(0)
    H, I, D, dtype = config.hidden_size, config.intermediate_size, config.head_dim, config.dtype

    def weight(n, k):
        bound = (3.0 / k) ** 0.5  # unit variance out for unit variance in
        return torch.empty(n, k, device=device, dtype=dtype).uniform_(-bound, bound, generator=gen)

    def ones(n):
        return torch.ones(n, device=device)

    qkv = config.q_dim + 2 * config.kv_dim
    return BlockWeights.of(ops, input_norm=ones(H), qkv=weight(qkv, H),
                           qkv_bias=torch.zeros(qkv, device=device) if config.attention_bias else None,
                           q_norm=ones(D) if config.qk_norm else None, k_norm=ones(D) if config.qk_norm else None,
                           o=weight(H, config.q_dim), post_norm=ones(H), gate_up=weight(2 * I, H), down=weight(H, I))


def decode_block_ms(device, timer: Timer, reps: int, config: dict = DECODE_BLOCK_CONFIG,
                    context: int = DECODE_BLOCK_CONTEXT, page: int = DECODE_BLOCK_PAGE,
                    layers: tuple[int, int] = DECODE_BLOCK_LAYERS) -> tuple[float, str]:
    """(milliseconds, how the step ran): what one decoder block of `config` (a config.json's
    fields; its torch_dtype the weights') adds to the GPU stage's decode step of one sequence
    whose token sits at `context` — the step of a stage of layers[1] blocks less that of one of
    layers[0], over their difference. Each stage is built as the loader builds a GPU stage (a
    slab KV pool, its decode graphs captured) and timed by `timer` through Stage.forward, as the
    engine steps it; what a step costs whatever its depth (the host's work, the index copy)
    cancels in the difference. Everything it allocated is given back before it returns."""
    cfg = ModelConfig.from_dict(config, source="the decode-block probe")
    device = torch.device(device)
    pages = -(-context // page)
    batch = StepBatch.build([("probe", context - 1, 1)])
    seconds, how = [], ""
    try:
        ops = TorchBackend()
        block = _block(cfg, device, ops)
        x = torch.randn(1, cfg.hidden_size, device=device, generator=torch.Generator(device=device).manual_seed(1))
        for n in layers:
            kv = KVCache(num_layers=n, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                         device=device, page_size=page, device_pages=pages, host_pages=0, slab=True)
            stage = Stage(cfg, 1, 1 + n, device, None, [block] * n, None, kv, ops)
            stage.fused.capture(1, pages)

            def step(stage=stage):
                return stage.forward(x, batch)

            if not torch.isfinite(step()).all():
                raise RuntimeError("the decode-block probe's step is not finite")
            seconds.append(min(timer(step, reps) for _ in range(3)))
            how = _how(stage.fused, pages)
            del stage, kv, step
    finally:
        # the compiled step holds a cycle (a bound method); its graphs' pools and weights go now
        block = x = ops = None
        gc.collect()
        if device.type == "cuda":
            _forget_capture_streams(device)
    return 1e3 * (seconds[1] - seconds[0]) / (layers[1] - layers[0]), how


def _how(step, pages: int) -> str:
    """How the stage's decode step ran: replayed as the CUDA graph of its bucket, or eagerly."""
    mode = "CUDA graph" if (1, pages) in step.captured else "eager" + (" (no CUDA)" if not step.graphs else "")
    return mode + (", torch.compile" if step.compiled else "")


def _forget_capture_streams(device) -> None:
    """cuBLAS keeps a workspace for every stream that ran a GEMM, for the life of the process: the
    probe stages' capture streams would leave theirs behind, and the profile would count them as
    VRAM the CUDA context reserves. So every workspace goes back, and the current stream's (the
    one the profile's earlier GEMMs had made) is made again by one GEMM. For a profile's process
    only: a CUDA graph captured beside it (a loaded model's) would replay on a workspace freed."""
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize(device)
