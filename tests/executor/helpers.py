"""Shared helpers for executor tests: run HELM and the transformers reference on one checkpoint."""
from __future__ import annotations

import torch

from executor.batch import StepBatch
from executor.engine import Engine
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.sampling import SamplingParams, StopCriteria


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
                               kv_slab=None) -> torch.Tensor:
    """Logits at every position of ids: one prefill step over ids[:prefill], then one decode step
    per remaining token (the KV cache path), as [len(ids), V] fp32."""
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, cfg.num_units if split is None else split, page_size_tokens=16,
                                     device_kv_pages=device_kv_pages)
    model = load_model(path, placement, cfg, backend=backend, kv_slab=kv_slab)
    rows = []

    def run(start, count, all_rows):
        batch = StepBatch.build([("s", start, count)], list(range(count)) if all_rows else None)
        x = torch.tensor(ids[start:start + count])
        for stage in model.stages:
            x = stage.forward(x, batch)
        rows.append(x.float())

    run(0, prefill, True)
    for pos in range(prefill, len(ids)):
        run(pos, 1, False)
    return torch.cat(rows)
