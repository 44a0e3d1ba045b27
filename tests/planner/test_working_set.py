"""The GPU stage's working set (planner/working_set.py) against hand computations; the trace's
activation peak against the model graph. tests/executor/test_working_set.py holds the activation
term against the executor's own decoder block."""
from __future__ import annotations

from dataclasses import replace

from planner.step_shape import step_tokens
from planner.trace import trace_model
from planner.working_set import cpu_working_bytes, gpu_working_bytes
from tests.planner.conftest import config_path
from tests.planner.helpers import unit

MIB = 2**20


def gpu_stage(blocks: int = 2):
    """Blocks of 32 query heads over 8 KV heads of 128 (attention FLOPs 16384 per context token =
    4·H_q·D, K+V 4096 B = 2·H_kv·D·2 bytes per token per layer), 1000 activation values per token
    at their peak; a head with 300 per token."""
    units = [replace(unit(i, "block", MIB, kv=4096, attn=16384), work_values_per_token=1000, attn_heads=32)
             for i in range(blocks)]
    return tuple(units) + (replace(unit(blocks, "head", MIB), work_values_per_token=300),)


def work(units, **kw):
    args = dict(dtype="bfloat16", batch=1, context=1024, page_size_tokens=512, budget_pages=2, device_pages=2,
                device_page_bytes=8 * MIB, flash_attention=True)
    return gpu_working_bytes(units, **{**args, **kw})


# a prompt chunk streamed: a page of fp32 scores per query head, its masks (and their tiling over
# 4), its K or V in fp32, 3 pages' device copies, the grouped queries, running output and a page's
# share (H_q·D = 4096) in fp32. tests/executor/test_working_set.py measures the executor against it.
STREAMED = 4 * 32 * 512 * 512 + 5 * 512 * 512 + 512 * 4096 * 4 // 4 + 3 * 512 * 4096 + 3 * 4 * 512 * 4096
# a prompt chunk of a sequence longer than the device pages, flash attention a page at a time: two
# pages of K/V, 14 bytes per query value (queries cast and regrouped, a page's output and its
# widening, the running output), five fp32 log-sum-exps per query head and query
SEGMENTED = 14 * 512 * 4096 + 2 * 512 * 4096 + 5 * 4 * 32 * 512


def test_each_term_by_hand():
    per_token = 5334                                  # ⌈1000 values · 4 B · 4/3⌉
    activations = 512 * per_token                     # a 512-token prompt chunk: batch 1
    logits = 2 * 300 * (4 + 2)                        # 2 sequences may share the 2 pages, fp32 beside bf16
    fused = 1024 * 4096 + 4 * 32 * 512                # the sequence's K/V at the context, one layer; flash's LSE
    graphs = 2 * 512 * (4096 + 2) + 2 * per_token     # bucket(2 pages) of keys and their bf16 mask; 2 rows
    scratch = 8 * MIB
    assert work(gpu_stage()) == activations + logits + fused + graphs + scratch
    # no flash attention (a GPU without it): every prompt chunk streams; not known: either may run
    assert STREAMED > fused
    assert work(gpu_stage(), flash_attention=False) == activations + logits + STREAMED + graphs + scratch
    assert work(gpu_stage(), flash_attention=None) == work(gpu_stage(), flash_attention=False)
    assert work(gpu_stage(), flash_attention=None, context=65536, budget_pages=128, device_pages=128) - \
        work(gpu_stage(), flash_attention=True, context=65536, budget_pages=128, device_pages=128) == 0
    # heads larger than flash attention's kernels take (D = 512 here): they stream
    wide = tuple(replace(u, attn_flops_per_context_token=4 * 32 * 512) if u.kind == "block" else u
                 for u in gpu_stage())
    assert work(wide) == work(wide, flash_attention=False) > 0
    # pages on the host (no device pages here): prompt chunks take flash attention a page at a
    # time, or stream where it does not run; no graphs, no scratch page
    assert work(gpu_stage(), device_pages=0) == activations + logits + SEGMENTED
    assert work(gpu_stage(), device_pages=0, flash_attention=False) == activations + logits + STREAMED
    # one page on the device: the larger of a chunk fused over the page's tokens and one a page at
    # a time, the graphs
    assert work(gpu_stage(), device_pages=1) == activations + logits + SEGMENTED + 512 * 4098 + per_token + scratch
    # the graphs' capture stream keeps its own cuBLAS workspace, where the profile measured it
    assert work(gpu_stage(), stream_workspace_bytes=32 * MIB) - work(gpu_stage()) == 32 * MIB
    assert work(gpu_stage(), device_pages=0, stream_workspace_bytes=32 * MIB) == work(gpu_stage(), device_pages=0)


def test_what_it_grows_with():
    units = gpu_stage()
    base = work(units)
    # a longer context: the gather of a prompt chunk grows with it, and nothing else (no mask)
    assert work(units, context=2048, budget_pages=4, device_pages=4) - work(units, budget_pages=4, device_pages=4) \
        == 1024 * 4096
    # ... up to the device pages' tokens: a longer sequence takes its chunks a page at a time
    assert work(units, context=8192, budget_pages=16, device_pages=4) == \
        work(units, context=4096, budget_pages=16, device_pages=4) > work(units, context=4096, budget_pages=4,
                                                                          device_pages=4)
    # a batch of 4: prompt chunks of 4 sequences in one step
    assert work(units, batch=4, budget_pages=8, device_pages=8) - work(units, budget_pages=8, device_pages=8) \
        == 3 * 512 * 5334
    assert step_tokens(4, 1024) == 2048 and step_tokens(8, 1024) == 2048 and step_tokens(1, 100) == 100
    # more pages: a larger decode gather (a bucket: 3 pages gather as 4), as many graph rows, a
    # third sequence's logits
    assert work(units, device_pages=3, budget_pages=3) - base == 2 * 512 * 4098 + 2 * 5334 + 300 * 6
    # the number of blocks does not matter: one layer's temporaries at a time
    assert work(gpu_stage(10)) == base
    # fp32 weights: no flash attention (its kernels are half precision), so chunks stream (the
    # same heads: K/V of 8192 B per token, copied as they are); the graphs' gather and mask double; no bf16 logits
    fp32 = tuple(replace(u, kv_bytes_per_token=8192) if u.kind == "block" else u for u in units)
    streamed_fp32 = STREAMED + 3 * 512 * 4096  # three pages' copies twice the size; a page's K or V in fp32 the same
    assert work(fp32, dtype="float32") - base == \
        streamed_fp32 - (1024 * 4096 + 4 * 32 * 512) + 2 * 512 * (4096 + 2) - 2 * 300 * 2
    # one KV head per query head: streamed masks are not tiled; the fused price does not change
    group1 = tuple(replace(u, attn_flops_per_context_token=4096) if u.kind == "block" else u for u in units)
    assert work(group1) == base
    assert work(units, device_pages=0, flash_attention=False) - work(group1, device_pages=0, flash_attention=False) \
        == 3 * 512 * 512 + 3 * 4 * 512 * 3072


def test_pages_parked_by_other_sequences_come_back_into_the_gather():
    """Offload with the device pages holding one whole sequence (2 pages of 512 at context 1024)
    of a budget of 4: no sequence outgrows them, so every prompt chunk gathers (flash) and none
    streams; a gather brings pages another sequence parked back, two pages' layer slices in
    transit (executor/kv_cache.py gathered). With fewer device pages than a sequence, chunks
    stream too, and the larger of the two is priced."""
    units = gpu_stage()
    in_transit = 2 * 512 * 4096
    assert work(units, budget_pages=4) - work(units) == in_transit + 2 * 300 * (4 + 2)  # and two more sequences' logits
    assert work(units, budget_pages=4) < work(units, budget_pages=4, device_pages=1) - 512 * 4098  # this one streams
    assert work(units, budget_pages=4, device_pages=1) - work(units, budget_pages=2, device_pages=1) == \
        2 * 300 * (4 + 2)  # the streamed price, which a gather of one page (+ the two in transit) is below


def test_edges():
    assert work(()) == 0                                               # no GPU stage
    head_only = gpu_stage()[-1:]
    assert work(head_only) == 2 * 300 * 6                              # logits only
    # the fit prices steps at mean batch sizes and contexts: memory rounds up to whole ones
    assert work(gpu_stage(), batch=1.5, budget_pages=2.5) == work(gpu_stage(), batch=2, budget_pages=3)
    # an IR traced before the peak was recorded prices what it can: gathers, pages
    old = tuple(replace(u, work_values_per_token=None) for u in gpu_stage())
    assert 0 < work(old) == work(gpu_stage()) - 514 * 5334 - 2 * 300 * 6


def test_the_trace_finds_the_mlp_peak():
    """A Qwen3-8B block (H 4096, I 12288) peaks in its MLP, where silu(gate), up and their product
    (I values each) are alive with the residual stream (H): 3·I + H values per token, measured in
    the traced prefill; every reused block gets its representative's."""
    ir = trace_model(config_path("qwen3-8b"))
    blocks = {u.work_values_per_token for u in ir.units if u.kind == "block"}
    assert blocks == {3 * 12288 + 4096}
    assert ir.units[-1].work_values_per_token == 151936 + 4096        # the logits beside the normed hidden state


def test_replanning_an_ir_traced_before_activations_says_what_it_cannot_price(laptop_plan_8b):
    from planner.planning import SEARCH_OBJECTIVE, STALE_IR_NOTE, replan

    old_ir = replace(laptop_plan_8b.ir, units=tuple(replace(u, work_values_per_token=None)
                                                    for u in laptop_plan_8b.ir.units))
    old = replace(laptop_plan_8b, ir=old_ir)
    again = replan(old, old.calibration, None)
    assert again.search.objective == SEARCH_OBJECTIVE + STALE_IR_NOTE
    assert replan(again, again.calibration, None).search.objective == SEARCH_OBJECTIVE + STALE_IR_NOTE
    stage, fresh = again.partition.stages[-1], replan(laptop_plan_8b, laptop_plan_8b.calibration, None)
    assert fresh.search.objective == SEARCH_OBJECTIVE
    assert 0 < stage.working_bytes < fresh.partition.stages[-1].working_bytes
    # an IR with activations but not attention heads (traced in between) is stale too
    headless = replace(laptop_plan_8b, ir=replace(laptop_plan_8b.ir, units=tuple(
        replace(u, attn_heads=None) for u in laptop_plan_8b.ir.units)))
    assert replan(headless, headless.calibration, None).search.objective == SEARCH_OBJECTIVE + STALE_IR_NOTE


def test_a_cpu_stage_by_hand():
    """The CPU stage's host working set: the same activations and logits as the GPU stage's (no
    graphs, no scratch page), its step a chunk for each sequence the KV budget holds where no GPU
    stage bounds it to the plan's batch; prompt chunks fused (K/V gathered, the mask untiled: the
    CPU kernel takes GQA as it is) or streamed, whichever is larger (the torch backend streams,
    the kernels' backend fuses); with a GPU stage, the hand-off and the logits coming back."""
    units = gpu_stage()

    def cpu(**kw):
        args = dict(dtype="bfloat16", batch=1, context=1024, page_size_tokens=512, budget_pages=2)
        return cpu_working_bytes(units, **{**args, **kw})

    per_token, logits = 5334, 2 * 300 * 6
    streamed = 4 * 32 * 512 * 512 + 5 * 512 * 512 + 512 * 4096 + 3 * 512 * 4096 + 3 * 4 * 512 * 4096
    assert streamed > 1024 * 4096 + 512 * 1024      # the fused term at this context
    # without a GPU stage: 2 sequences may share the 2 pages, a 512-token chunk each
    assert cpu() == 1024 * per_token + logits + streamed
    # 64 sequences at most, 2048 tokens at most, and no more than the pages hold
    assert cpu(budget_pages=200) == 2048 * per_token + 64 * 300 * 6 + streamed
    assert cpu(page_size_tokens=16, budget_pages=3) == 48 * per_token + 3 * 300 * 6 + cpu_streamed(16)
    # a long context: the fused term (fp16: K/V widened to fp32 for the CPU's fused kernel)
    fused = 65536 * 4096 + 512 * 65536
    assert cpu(context=65536) - 1024 * per_token - logits == fused
    assert cpu(context=65536, dtype="float16") - cpu(context=65536) == 2 * 65536 * 4096
    # a GPU stage after it (with the head, 100 hidden values a token crossing): its batch bounds
    # the step, the hidden states go over in fp32, its logits come back in fp32
    cut = replace(units[-2], act_bytes_per_token=200)
    blocks = units[:-2] + (cut,)
    gpu = (replace(units[-1], work_values_per_token=500),)
    assert cpu_working_bytes(blocks, dtype="bfloat16", batch=1, context=1024, page_size_tokens=512,
                             budget_pages=2, gpu_units=gpu) == 512 * per_token + streamed + 512 * 400 + 2 * 4 * 500
    assert cpu_working_bytes((), dtype="bfloat16", batch=1, context=1024, page_size_tokens=512, budget_pages=2) == 0
    # every unit on the GPU: the host still receives the logits of each sequence (it samples)
    assert cpu_working_bytes((), dtype="bfloat16", batch=1, context=1024, page_size_tokens=512, budget_pages=2,
                             gpu_units=units) == 2 * 4 * 300
    assert cpu_working_bytes((), dtype="bfloat16", batch=1, context=1024, page_size_tokens=512, budget_pages=200,
                             gpu_units=units) == 64 * 4 * 300


def cpu_streamed(page):
    return (4 * 32 * 512 * page + 5 * 512 * page + page * 4096 + 3 * page * 4096 + 3 * 4 * 512 * 4096)
