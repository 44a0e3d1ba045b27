"""The fused decode step (executor.backends.FusedBlocks over kernels.BlockStack) against the
op-by-op kernel path it replaces: the same kernels in the same order, so logits must be
bit-identical, for every family, dtype, page layout and batch shape it accepts."""
from __future__ import annotations

import pytest
import torch

from executor.backends import FusedBlocks, resolve_backend
from executor.engine import Engine
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.request_params import SamplingParams, StopCriteria
from tests.executor.helpers import helm_teacher_forced_logits, prompt_ids

pytestmark = pytest.mark.skipif(resolve_backend("auto") != "helm", reason="CPU kernels not built")


def _op_by_op(monkeypatch):
    monkeypatch.setattr(FusedBlocks, "accepts", lambda self, batch: False)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_fused_logits_equal_op_by_op(checkpoint, arch, dtype, monkeypatch):
    """A 20-token prefill (fused or op by op, as this machine's measured routes and attention
    limit decide) then 20 fused decode steps over 16-token pages: every logit the same bits."""
    path = checkpoint(arch, dtype)
    ids = prompt_ids(40, 1024, seed=3)
    calls = []
    real_call = FusedBlocks.__call__
    monkeypatch.setattr(FusedBlocks, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    fused = helm_teacher_forced_logits(path, ids, prefill=20)
    assert len(calls) >= 20, "the fused path did not run"
    _op_by_op(monkeypatch)
    reference = helm_teacher_forced_logits(path, ids, prefill=20)
    assert torch.equal(fused, reference)


def test_fused_long_context_equals_op_by_op(checkpoint, monkeypatch):
    """Decode steps at 2031..2048 keys over 16-token pages: the last attends in two key segments
    per (KV head, query) (helm_att_split), merged by whichever thread finishes last."""
    path = checkpoint("qwen3", "bf16")
    ids = prompt_ids(2048, 1024, seed=4)
    fused = helm_teacher_forced_logits(path, ids, prefill=2030)
    _op_by_op(monkeypatch)
    assert torch.equal(fused, helm_teacher_forced_logits(path, ids, prefill=2030))


@pytest.mark.parametrize("dtype,route,limit,max_rows", [("fp32", ("float32", "gemm", 20), 16, 19),
                                                        ("bf16", ("bfloat16", "torch", 13), 4, 12),
                                                        ("bf16", ("bfloat16", "gemv", 9), 32, 32)])
def test_fused_steps_are_decode_batches_and_short_chunks(checkpoint, dtype, route, limit, max_rows):
    """Up to max_rows tokens (where the placement's GEMM route keeps every projection in our GEMV;
    at most FusedBlocks.MAX_ROWS) whose sequences each have at most `limit` of them (the
    attention kernel's share, as measured; a longer chunk needs PyTorch's)."""
    from dataclasses import replace

    from executor.batch import StepBatch
    from executor.kernels import KERNEL_ISA
    from executor.placement import KernelChoice

    path = checkpoint("qwen3", dtype)
    cfg = ModelConfig.from_dir(path)
    choice = KernelChoice(KERNEL_ISA, torch.get_num_threads(), (route,), limit)
    placement = replace(Placement.from_split(cfg.num_units, cfg.num_units), kernel_choice=choice)
    model = load_model(path, placement, cfg, backend="helm")
    fused = model.stages[0].fused
    assert fused.max_rows == max_rows
    assert fused.accepts(StepBatch.build([(i, 5, 1) for i in range(max_rows)]))  # decode batch
    assert not fused.accepts(StepBatch.build([(i, 5, 1) for i in range(max_rows + 1)]))
    assert fused.accepts(StepBatch.build([(0, 0, min(limit, max_rows))]))  # a short prompt chunk
    assert not fused.accepts(StepBatch.build([(0, 0, limit + 1)]))


def _engine_run(path, prompts, page_size, device_kv_pages=None, split=None):
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, cfg.num_units if split is None else split,
                                     page_size_tokens=page_size, device_kv_pages=device_kv_pages)
    engine = Engine(load_model(path, placement, cfg, backend="helm"))
    seqs = engine.generate(prompts, SamplingParams(temperature=0.8, seed=11),
                           StopCriteria(max_new_tokens=12, ignore_eos=True))
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("page_size,device_kv_pages,split", [(4, None, None), (3, 6, 2)])
def test_fused_batched_decode_equals_op_by_op(checkpoint, monkeypatch, page_size, device_kv_pages, split):
    """Three sequences of different lengths decoded together (one fused call per step, work items
    from every sequence), seeded sampling; and a split with a bounded KV pool, whose evictions move
    pages (the page tables are rebuilt)."""
    path = checkpoint("qwen3", "bf16")
    prompts = [prompt_ids(n, 1024, seed=n) for n in (3, 9, 6)]
    fused = _engine_run(path, prompts, page_size, device_kv_pages, split)
    _op_by_op(monkeypatch)
    assert fused == _engine_run(path, prompts, page_size, device_kv_pages, split)


def test_block_stack_rejects_bad_arguments(checkpoint):
    path = checkpoint("qwen3")
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, Placement.from_split(cfg.num_units, cfg.num_units), cfg, backend="helm")
    stack = model.stages[0].fused.stack
    cos = sin = torch.zeros(1, cfg.head_dim // 2)
    table = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="columns"):
        stack(torch.zeros(1, cfg.hidden_size + 1), cos, sin, [(0, 1, 0, table)])
    with pytest.raises(ValueError, match="do not cover"):
        stack(torch.zeros(1, cfg.hidden_size), cos, sin, [(0, 1, 600, table)])
    with pytest.raises(ValueError, match="cover 1 rows"):
        stack(torch.zeros(2, cfg.hidden_size), torch.zeros(2, cfg.head_dim // 2),
              torch.zeros(2, cfg.head_dim // 2), [(0, 1, 0, table)])
    with pytest.raises(ValueError, match="continue from row"):
        stack(torch.zeros(1, cfg.hidden_size), cos, sin, [(1, 1, 0, table)])
    with pytest.raises(ValueError, match="int64"):
        stack(torch.zeros(1, cfg.hidden_size), cos, sin, [(0, 1, 0, table.int())])
