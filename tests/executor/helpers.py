"""Shared helpers for executor tests: run HELM and the transformers reference on one checkpoint."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from executor.backends import TorchBackend
from executor.batch import StepBatch
from executor.device_step import ResidentDecode
from executor.kv_cache import KVCache
from executor.stage import BlockWeights
from executor.engine import Engine
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.request_params import SamplingParams, StopCriteria


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n ordinary token ids (the low ids hold special tokens in our test tokenizers)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 256), (n,), generator=g).tolist()


def helm_generate(path, prompts, split=None, sampling=None, max_new_tokens=32, page_size=512,
                  device_kv_pages=None, backend="auto", kv_slab=None, **engine_kw):
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, cfg.num_units if split is None else split,
                                     page_size_tokens=page_size, device_kv_pages=device_kv_pages)
    model = load_model(path, placement, cfg, backend=backend, kv_slab=kv_slab)
    engine = Engine(model, **engine_kw)
    stop = StopCriteria(max_new_tokens=max_new_tokens, ignore_eos=True)
    seqs = engine.generate(prompts, sampling or SamplingParams(), stop)
    return [s.output_ids for s in seqs], model


def budget_engine(path, sequences, context, split=2, device_kv_pages=None, page_size=4, backend="auto", **kw):
    """An engine whose placement carries a plan's KV budget (what plan_io.placement_for sets):
    `sequences` of `context` tokens."""
    from dataclasses import replace

    cfg = ModelConfig.from_dir(path)
    placement = replace(Placement.from_split(cfg.num_units, split, page_size_tokens=page_size,
                                             device_kv_pages=device_kv_pages),
                        kv_sequences=sequences, context_tokens=context)
    placement.validate()
    return Engine(load_model(path, placement, cfg, backend=backend), eos_token_ids=(), **kw)


def pages_in_use(engine):
    """Pages sequences hold (pages only the prefix cache keeps give way when a pool needs room)."""
    stats = [s.kv.stats() for s in engine.model.stages if s.kv]
    return sum(st.device_pages_used + st.host_pages_used - st.cached_pages for st in stats)


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model


def hf_greedy(path, prompt, max_new_tokens):
    model = hf_model(path)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as --ignore-eos
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def helm_teacher_forced_logits(path, ids, prefill: int, split=None, backend="auto", device_kv_pages=None,
                               kv_slab=None, loaded=None, prefill_chunk: int | None = None) -> torch.Tensor:
    """Logits at every position of ids: prefill steps over ids[:prefill] (one, or chunks of
    prefill_chunk tokens each after the ones before), then one decode step per remaining token
    (the KV cache path), as [len(ids), V] fp32. loaded: called with the model once it is loaded
    (to look at which paths it took)."""
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, cfg.num_units if split is None else split, page_size_tokens=16,
                                     device_kv_pages=device_kv_pages)
    model = load_model(path, placement, cfg, backend=backend, kv_slab=kv_slab)
    if loaded is not None:
        loaded(model)
    rows = []

    def run(start, count, all_rows):
        batch = StepBatch.build([("s", start, count)], list(range(count)) if all_rows else None)
        x = torch.tensor(ids[start:start + count])
        for stage in model.stages:
            x = stage.forward(x, batch)
        rows.append(x.float())

    step = prefill_chunk or prefill
    for start in range(0, prefill, step):
        run(start, min(step, prefill - start), True)
    for pos in range(prefill, len(ids)):
        run(pos, 1, False)
    return torch.cat(rows)


class _Launches(TorchDispatchMode):
    """The ops run on the meta device that would each launch a kernel on CUDA: every aten op but
    views and allocations. PyTorch's fused RMSNorm and SDPA (one kernel each on CUDA, decomposed
    on the meta device) are counted by `fused`."""

    NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "_unsafe_view"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def fused(self, out: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not view and func.overloadpacket.__name__ not in self.NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


def decode_step_launches(cfg: ModelConfig, layers: int, rows: int = 1, pages: int = 8) -> int:
    """Kernels the GPU stage's static decode step (executor/device_step.py) launches over `layers`
    blocks of `cfg`'s shapes at (rows, pages), counted on the meta device: the CUDA branches of
    the code, no memory."""
    meta, H, D = torch.device("meta"), cfg.hidden_size, cfg.head_dim

    def vec(n):
        return torch.empty(n, device=meta)

    def weight(n, k):
        return torch.empty(n, k, dtype=cfg.dtype, device=meta)

    ops = TorchBackend()
    qkv = cfg.q_dim + 2 * cfg.kv_dim
    blocks = [BlockWeights.of(ops, input_norm=vec(H), qkv=weight(qkv, H), qkv_bias=vec(qkv) if cfg.attention_bias else None,
                              q_norm=vec(D) if cfg.qk_norm else None, k_norm=vec(D) if cfg.qk_norm else None,
                              o=weight(H, cfg.q_dim), post_norm=vec(H), gate_up=weight(2 * cfg.intermediate_size, H),
                              down=weight(H, cfg.intermediate_size))
              for _ in range(layers)]
    kv = KVCache(num_layers=layers, num_kv_heads=cfg.num_kv_heads, head_dim=D, dtype=cfg.dtype, device=meta,
                 page_size=16, device_pages=64, host_pages=0, slab=True)
    step = ResidentDecode(cfg, blocks, kv, ops.attention(cfg, kv), ops, graphs=False, compiled=False)
    x = torch.empty(rows, H, device=meta)
    index = torch.zeros(rows, 3 + pages, dtype=torch.int64, device=meta)
    # The stand-ins lay their inputs and outputs out as CUDA's kernels do: the fused norm copies a
    # strided input first; memory-efficient attention writes [B, M, H, D] and returns it transposed.
    with pytest.MonkeyPatch.context() as patch, _Launches() as launches:
        patch.setattr(F, "rms_norm", lambda x, *a, **kw: launches.fused(torch.empty_like(x.contiguous())))
        patch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: launches.fused(
            q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)))
        step.step(x, index)
    return launches.count
