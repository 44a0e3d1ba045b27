"""A plan's KV budget in the executor: the pages the planner checked, whatever page size runs, and
the host memory they take counted before loading (issue 11: admission follows the plan)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from executor.errors import PlacementError
from executor.loader import kv_pools
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.plan_io import check_host_kv_fits, placement_for
from planner.planning import plan_for_split, workload_for


@pytest.fixture(scope="module")
def offload_plan(checkpoint):
    """A split plan with KV offload on: 4 device pages of 16 tokens of a 256-token context."""
    path = checkpoint("qwen3", "fp32")
    plan = plan_for_split(str(path), split_k=2, page_size_tokens=16, kv_offload=True,
                          workload=workload_for(128, 128))
    kv = replace(plan.kv, device_pages=4, host_pages=plan.kv.pages_per_sequence - 4)
    return replace(plan, kv=kv), ModelConfig.from_dir(path)


def test_a_page_size_override_keeps_the_planned_tokens_on_the_device(offload_plan, caplog):
    plan, config = offload_plan
    assert plan.kv.page_size_tokens == 16 and plan.workload.context_tokens == 256
    for page, device_pages in ((16, 4), (64, 1), (4, 16)):
        placement = placement_for(plan, config, page_size_tokens=page)
        assert placement.device_kv_pages == device_pages             # 64 tokens of VRAM, as planned
        assert placement.kv_budget_pages == 256 // page               # one sequence of 256 tokens
        assert kv_pools(placement, "cuda") == (device_pages, 256 // page - device_pages)
        assert kv_pools(placement, "cpu") == (256 // page, 0)
    assert "device pool holds" not in caplog.text
    # a page that does not divide the planned tokens: the pool holds fewer, and the log says so
    assert placement_for(plan, config, page_size_tokens=48).device_kv_pages == 1
    assert "device pool holds 48 tokens where the plan priced 64 (4 pages of 16)" in caplog.text


def test_the_host_check_counts_the_pages_offload_parks_there(offload_plan, monkeypatch):
    plan, config = offload_plan
    placement = placement_for(plan, config)
    token_bytes = 2 * config.num_kv_heads * config.head_dim * 4            # fp32
    cpu_layers, gpu_layers = 1, config.num_layers - 1                       # split 2: block 0 on the CPU
    monkeypatch.setattr("executor.plan_io.resolve_device", lambda d: __import__("torch").device(d))  # as with CUDA
    need = (16 * cpu_layers + 12 * gpu_layers) * 16 * token_bytes           # 16 CPU pages, 12 parked GPU pages
    with pytest.raises(PlacementError, match="KV budget of 16 pages"):
        check_host_kv_fits(placement, config, 64, available=need - 1)
    check_host_kv_fits(placement, config, 64, available=need)


def test_a_budget_needs_a_sequence_and_a_context():
    base = Placement.from_split(6, 3)
    for bad in (dict(kv_sequences=0, context_tokens=16), dict(kv_sequences=1), dict(context_tokens=16),
                dict(kv_sequences=1, context_tokens=1)):
        with pytest.raises(PlacementError):
            replace(base, **bad).validate()
    replace(base, kv_sequences=2, context_tokens=16).validate()


def test_a_plan_records_its_streaming_policy_and_the_placement_follows_it(tmp_path):
    """The laptop's Qwen3-8B plan: its CPU stage's prompt steps stream from the plan's row count
    (written, read back), which the executor's placement carries."""
    import json

    from planner.machine import load_machine
    from planner.plan import load_plan, save_plan
    from planner.planning import make_plan

    config = "tools/model_configs/qwen3-8b.json"
    plan = make_plan(config, load_machine("plans/machines/laptop-rtx4060-i7-13700h.yaml"), source=config)
    rows = plan.partition.stream_prefill_min_rows
    assert rows is not None and 1 <= rows <= plan.workload.prompt_tokens
    save_plan(plan, tmp_path / "p.yaml")
    assert load_plan(tmp_path / "p.yaml").partition.stream_prefill_min_rows == rows
    assert "Prompt steps of >= %d tokens" % rows in plan.to_yaml()
    with open(config) as f:
        placement = placement_for(plan, ModelConfig.from_dict(json.load(f)))
    assert placement.stream_prefill_min_rows == rows
    step = plan.partition.stream_prefill_step_tokens  # and the most tokens a streamed step takes
    assert step == plan.workload.context_tokens and load_plan(tmp_path / "p.yaml").partition.stream_prefill_step_tokens == step
    assert placement.stream_prefill_step_tokens == step and f"up to {step} tokens a step" in plan.to_yaml()


def test_a_recorder_measures_a_model_against_the_policy_it_runs():
    """A model that could not stream its plan's prompt steps (the weights' page lock refused) is
    measured against their CPU time: its Recorder is given the policy the load runs."""
    from dataclasses import replace as swap

    from executor.report import Recorder
    from planner.machine import load_machine
    from planner.planning import make_plan
    from planner.predict import predict_step

    config = "tools/model_configs/qwen3-8b.json"
    plan = make_plan(config, load_machine("plans/machines/laptop-rtx4060-i7-13700h.yaml"), source=config)
    assert plan.partition.stream_prefill_min_rows is not None
    streamed = Recorder(plan, "test", "Qwen3ForCausalLM", "test").predict("prefill", 512, 1, 512)[0].ms
    on_cpu = Recorder(plan, "test", "Qwen3ForCausalLM", "test", stream_prefill=False).predict("prefill", 512, 1, 512)[0].ms
    unstreamed = swap(plan, partition=swap(plan.partition, stream_prefill_min_rows=None))
    assert on_cpu == pytest.approx(predict_step(unstreamed, "prefill", 512, 1, 512).stages[0][0])
    assert on_cpu > 5 * streamed  # the CPU's GEMMs against the link's crossing


def test_decodes_riding_along_in_a_streamed_step_are_priced_their_kv_copies():
    """A prefill step's decodes are left out of its shape, but where the step streams the CPU
    stage's blocks to the GPU each of them copies its cached K/V in per block, and its new
    token's out: the prediction adds that to the CPU stage, from Qwen3-8B's own K/V size (8 KV
    heads of 128 in bf16, K and V: 4096 bytes a token a block) and the laptop's link."""
    from executor.report import Recorder
    from planner.machine import load_machine
    from planner.planning import make_plan
    from planner.units import GIB

    config = "tools/model_configs/qwen3-8b.json"
    plan = make_plan(config, load_machine("plans/machines/laptop-rtx4060-i7-13700h.yaml"), source=config)
    assert plan.partition.stream_prefill_min_rows <= 512
    blocks = plan.partition.split_k - 1  # the CPU stage: the embedding and k - 1 blocks
    link = plan.machine.link
    rec = Recorder(plan, "test", "Qwen3ForCausalLM", "test")
    alone = rec.predict("prefill", 512, 1, 512)
    riding = rec.predict("prefill", 512, 1, 512, 4, 4000)  # 4 decodes over 1000 cached tokens each
    copies = 1e3 * blocks * 4096 * (4000 / (link.h2d_gibps * GIB) + 4 / (link.d2h_gibps * GIB))
    assert riding[0].ms - alone[0].ms == pytest.approx(copies) and copies > 10
    assert riding[0].roofline_ms - alone[0].roofline_ms == pytest.approx(copies)
    # the GPU stage's work is the same, but the decodes take rows of its sub-steps: the 512-token
    # chunk no longer fits the first one beside them (the plan's δ is 0: no time for it yet)
    assert [p.ms for p in riding[1:]] == [p.ms for p in alone[1:]]
    assert riding[1].overheads == 2 * alone[1].overheads
    # on the CPU (a step below the threshold, or a load that streams nothing) they ride for free
    small = plan.partition.stream_prefill_min_rows - 1
    assert rec.predict("prefill", 512, 1, small, 4, 4000) == rec.predict("prefill", 512, 1, small)
    on_cpu = Recorder(plan, "test", "Qwen3ForCausalLM", "test", stream_prefill=False)
    assert on_cpu.predict("prefill", 512, 1, 512, 4, 4000) == on_cpu.predict("prefill", 512, 1, 512)
