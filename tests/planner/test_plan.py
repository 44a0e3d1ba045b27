"""The plan file: contract with the executor, determinism, validation, digest, checked-in plans."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import yaml

from planner import cli
from planner.config import config_digest
from planner.cost import stream_ring_bytes
from planner.errors import PlanError
from planner.machine import load_machine
from planner.plan import Plan, header_lines, load_plan, plan_digest, plan_from_dict, save_plan, seal, Workload
from planner.planning import SEARCH_OBJECTIVE, make_plan, plan_for_split, workload_for
from planner.predict import predict, predict_step
from planner.units import GIB
from planner.working_set import gpu_working_bytes, streamed_step_bytes
from tests.planner.conftest import REPO, config_path, rel_source

# Every checked-in plan and the command that makes it (also listed in plans/README.md).
CHECKED_IN = {
    "plans/qwen3-8b.laptop-rtx4060.yaml":
        ["tools/model_configs/qwen3-8b.json", "--machine", "plans/machines/laptop-rtx4060-i7-13700h.yaml"],
    "plans/llama-3.2-1b.laptop-rtx4060.yaml":
        ["tools/model_configs/llama-3.2-1b.json", "--machine", "plans/machines/laptop-rtx4060-i7-13700h.yaml"],
    "plans/qwen3-8b.helm-dev-2core.yaml":
        ["tools/model_configs/qwen3-8b.json", "--machine", "plans/machines/helm-dev-2core.yaml"],
    "plans/qwen3-0.6b.helm-dev-2core.yaml":
        ["tools/model_configs/qwen3-0.6b.json", "--machine", "plans/machines/helm-dev-2core.yaml"],
    "plans/qwen3-0.6b.helm-dev-2core-avx2.yaml":
        ["tools/model_configs/qwen3-0.6b.json", "--machine", "plans/machines/helm-dev-2core-avx2.yaml"],
    "plans/qwen3-32b.workstation-rtx4090.yaml":
        ["tools/model_configs/qwen3-32b.json", "--machine", "plans/machines/workstation-rtx4090-r9-7950x.yaml"],
}


def test_executor_contract_fields(laptop_plan_8b):
    p = laptop_plan_8b
    assert isinstance(p, Plan) and p.plan_version == 1 and p.digest.startswith("sha256:")
    assert p.model.architecture == "Qwen3ForCausalLM" and p.model.dtype == "bfloat16"
    assert p.model.config_digest == config_digest(config_path("qwen3-8b"))
    assert p.partition.num_units == 38 and p.partition.split_k == 22
    assert [(s.device, s.unit_start, s.unit_end) for s in p.partition.stages] == [("cpu", 0, 22), ("cuda", 22, 38)]
    assert all(s.working_bytes > 0 for s in p.partition.stages)
    assert all(s.weight_bytes > 0 for s in p.partition.stages)
    assert (p.kv.page_size_tokens, p.kv.watermark, p.kv.offload) == (512, 0.8, False)
    assert (p.kv.device_pages, p.kv.host_pages) == (2, 0)
    assert p.workload.context_tokens == 1024 and p.machine.cpu.cores == 14
    with pytest.raises(Exception):
        p.partition.split_k = 3          # frozen


def test_write_read_write_gives_identical_bytes(laptop_plan_8b, tmp_path):
    text = laptop_plan_8b.to_yaml()
    again = load_plan(text)
    assert again == laptop_plan_8b and again.to_yaml() == text
    path = tmp_path / "p.yaml"
    save_plan(again, path)
    assert path.read_text() == text and load_plan(path) == laptop_plan_8b
    lines = text.splitlines()
    assert lines[0].startswith("# HELM plan v1: Qwen3ForCausalLM") and "k=22 of 38" in lines[0]
    assert "MiB working set)" in lines[0]
    assert lines[1].startswith("# Predicted") and lines[2].startswith("# Why: k=21") and "working set" in lines[2]
    assert lines[3].startswith("# Longest context at batch 1: 3072 tokens") and "with KV offload" in lines[3]
    assert lines[4].startswith("# Prompt steps of >= 32 tokens run the CPU stage's blocks on the GPU")
    assert lines[4].endswith("up to 1024 tokens a step.")  # the plan's context: a step holds no more
    assert not lines[5].startswith("#")


def test_same_inputs_give_the_same_bytes(laptop):
    from planner.trace import _trace_cached
    first = make_plan(config_path("qwen3-0.6b"), laptop, source=rel_source("qwen3-0.6b")).to_yaml()
    _trace_cached.cache_clear()                                  # trace again from scratch
    assert make_plan(config_path("qwen3-0.6b"), laptop, source=rel_source("qwen3-0.6b")).to_yaml() == first


@pytest.mark.parametrize("target", sorted(CHECKED_IN))
def test_checked_in_plans_are_reproduced_byte_for_byte(target, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "plan.yaml"
    assert cli.main(["plan", *CHECKED_IN[target], "-o", str(out)]) == 0
    assert out.read_text() == (REPO / target).read_text(), f"{target} is stale: regenerate it (plans/README.md)"
    assert cli.main(["validate", target]) == 0


def test_schema_failures_name_the_field_path(laptop_plan_8b):
    data = laptop_plan_8b.to_dict()
    bad = copy.deepcopy(data)
    bad["partition"]["stages"][0]["device"] = "gpu"
    with pytest.raises(PlanError, match=r"field 'partition\.stages\[0\]\.device': must be one of 'cpu', 'cuda'"):
        plan_from_dict(bad)
    bad = copy.deepcopy(data)
    del bad["kv"]["watermark"]
    with pytest.raises(PlanError, match=r"field 'kv': misses required field watermark"):
        plan_from_dict(bad)
    bad = copy.deepcopy(data)
    bad["machine"]["cpu"]["dram_read_gibps"] = "fast"
    with pytest.raises(PlanError, match=r"field 'machine\.cpu\.dram_read_gibps': must be of type number$"):
        plan_from_dict(bad)
    with pytest.raises(PlanError, match="malformed YAML"):
        load_plan("a: [1,\nb: 2")
    with pytest.raises(PlanError, match="not found"):
        load_plan("no/such/plan.yaml")


def test_a_tampered_plan_is_rejected_by_its_digest(laptop_plan_8b):
    text = laptop_plan_8b.to_yaml()
    tampered = text.replace("  watermark: 0.8\n", "  watermark: 0.7\n", 1)
    assert tampered != text
    with pytest.raises(PlanError, match="digest mismatch at field 'digest'"):
        load_plan(tampered)
    assert load_plan(tampered, verify_digest=False).kv.watermark == 0.7
    # a matching digest over inconsistent content is still caught
    data = yaml.safe_load(text.replace("  split_k: 22\n", "  split_k: 21\n", 1))
    data["digest"] = plan_digest(data)
    with pytest.raises(PlanError, match=r"inconsistent plan at field 'partition.stages'"):
        plan_from_dict(data)


def test_key_order_and_number_formatting_do_not_change_the_plan(laptop_plan_8b):
    data = laptop_plan_8b.to_dict()
    text = yaml.safe_dump(json.loads(json.dumps(data)), sort_keys=True, default_flow_style=True)
    assert load_plan(text) == laptop_plan_8b


def test_plan_for_split_on_a_checkpoint_without_profiling(checkpoint):
    ckpt = checkpoint("qwen3", "bf16")
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"] + 2
    p = plan_for_split(ckpt, split_k=2)
    assert p.partition.forced and p.partition.split_k == 2 and p.machine.source == "placeholder"
    assert [(s.device, s.unit_start, s.unit_end) for s in p.partition.stages] == [("cpu", 0, 2), ("cuda", 2, n)]
    assert p.model.config_digest == config_digest(ckpt) == config_digest(ckpt / "config.json")
    assert load_plan(p.to_yaml()) == p
    all_cpu = plan_for_split(ckpt, split_k=n, page_size_tokens=16)
    assert [s.device for s in all_cpu.partition.stages] == ["cpu"] and all_cpu.kv.page_size_tokens == 16


def test_the_search_weighs_the_prompt_where_a_split_leaves_no_room_to_stream_it(laptop):
    """Qwen3-8B on the laptop at 16k tokens of context: one unit more on the GPU (k=24) decodes
    faster, but leaves no VRAM for the streamed prompt steps' ring, so its prompts run on the CPU;
    the plan takes k=25, which serves the workload's request (512 + 512 tokens) sooner."""
    from planner.planning import replan

    plan = make_plan(config_path("qwen3-8b"), laptop, workload=workload_for(512, 512, context_tokens=16384))
    cands = {c.split_k: c for c in plan.search.candidates}
    k = plan.partition.split_k
    faster_decode = cands[k - 1]
    assert faster_decode.feasible and faster_decode.total_ms < cands[k].total_ms
    assert plan.partition.stream_prefill_min_rows is not None
    assert plan_for_split(config_path("qwen3-8b"), k - 1, laptop, workload=workload_for(512, 512, context_tokens=16384)) \
        .partition.stream_prefill_min_rows is None  # no ring beside k - 1's KV
    request_s = {j: (c.ttft_ms + 511 * c.total_ms) / 1e3 for j, c in cands.items() if c.feasible}
    assert min(request_s, key=lambda j: (request_s[j], -j)) == k
    assert faster_decode.ttft_ms > 10 * cands[k].ttft_ms
    assert f"k={k - 1} serves the workload's request slower" in header_lines(plan)[2]
    # a plan made before the candidates carried their TTFT reads as before, and re-planning it (as
    # recalibration does) ranks by the request, saying so
    old = dataclasses.replace(plan, search=dataclasses.replace(
        plan.search, objective="minimum predicted ms/token among feasible splits (ties: larger k)",
        candidates=tuple(dataclasses.replace(c, ttft_ms=None) for c in plan.search.candidates)))
    old = load_plan(seal(old).to_yaml())
    candidate_lines = [line for line in old.to_yaml().splitlines() if line.startswith("  - {split_k")]
    assert len(candidate_lines) == 39 and not any("ttft_ms" in line for line in candidate_lines)
    assert f"k={k - 1} is slower" in header_lines(old)[2]
    assert replan(old, old.calibration, None).search.objective == SEARCH_OBJECTIVE


def test_forced_and_impossible_requests_are_clear_errors(laptop):
    path = config_path("qwen3-8b")
    with pytest.raises(PlanError, match=r"--split 0 is infeasible on laptop-rtx4060-i7-13700h: cuda weights need"):
        make_plan(path, laptop, split_k=0)
    assert make_plan(path, laptop, split_k=0, allow_infeasible=True).search.best_feasible_k == 22
    with pytest.raises(PlanError, match="out of range.*0..38"):
        make_plan(path, laptop, split_k=39)
    with pytest.raises(PlanError, match="--gpu-memory 64.00 GiB is more than the GPU has"):
        make_plan(path, laptop, gpu_memory_bytes=64 * GIB)
    with pytest.raises(PlanError, match="--host-memory .* more than the machine has"):
        make_plan(path, laptop, host_memory_bytes=1024 * GIB)
    with pytest.raises(PlanError, match=r"(?s)no feasible split.*all-CPU \(k=38\) needs 15.67 GiB host memory, "
                                        r"1.00 GiB available.*all-GPU \(k=0\) needs"):
        make_plan(path, laptop, host_memory_bytes=GIB)
    with pytest.raises(PlanError, match="shorter than prompt"):
        make_plan(path, laptop, workload=workload_for(512, 512, 1, 100))


def test_tighter_gpu_cap_moves_units_to_the_cpu(laptop):
    k = [make_plan(config_path("qwen3-8b"), laptop, gpu_memory_bytes=g * GIB).partition.split_k for g in (7, 5, 3)]
    assert k[0] == 22 and k[0] < k[1] < k[2]


def test_kv_offload_parks_pages_on_the_host_when_vram_runs_out(laptop):
    wl = workload_for(11776, 512)                # 24 pages of 512 tokens per sequence
    path = config_path("qwen3-8b")
    with pytest.raises(PlanError, match="--split 22 is infeasible.*KV"):
        make_plan(path, laptop, workload=wl, split_k=22)
    off = make_plan(path, laptop, workload=wl, split_k=22, kv_offload=True)
    assert off.kv.offload and off.kv.device_pages + off.kv.host_pages == off.kv.pages_per_sequence == 24
    assert off.kv.host_pages > 0 and off.kv.device_pages >= 2
    # the device keeps the most pages that stay under the watermark of the VRAM left after weights
    # and the working set, and fit beside the working set they grow (the decode graphs' gather)
    gpu, kv, budget = off.partition.stages[1], off.kv, off.limits.gpu_budget_bytes

    # the ring of weight pieces the CPU stage's streamed prompt steps use is in the working set too
    assert off.partition.stream_prefill_min_rows is not None
    ring = stream_ring_bytes(off.ir.units, 22)

    # the streamed steps the plan took (the largest beside these pages, or larger ones that
    # parked more of them where the request is served sooner so)
    step = streamed_step_bytes(off.ir.units[1:22], off.partition.stream_prefill_step_tokens, 512, "bfloat16", 12288)

    def work(pages):
        return ring + gpu_working_bytes(off.ir.units[22:], dtype="bfloat16", batch=1, context=12288,
                                        page_size_tokens=512, budget_pages=24, device_pages=pages,
                                        device_page_bytes=kv.device_page_bytes,
                                        flash_attention=laptop.gpu.flash_attention, streamed_step=step)

    def fits(pages):
        return (pages <= 0.8 * (budget - gpu.weight_bytes - work(0)) // kv.device_page_bytes
                and gpu.weight_bytes + pages * kv.device_page_bytes + work(pages) <= budget)

    assert fits(kv.device_pages) and not fits(kv.device_pages + 1) and gpu.working_bytes == work(kv.device_pages)
    # streaming those pages back each step costs time: the search weighs it against moving blocks
    best = make_plan(path, laptop, workload=wl, kv_offload=True)
    assert best.prediction.ms_per_token <= off.prediction.ms_per_token


def test_kv_offload_parks_no_page_where_every_page_fits():
    """--kv-offload parks the pages that do not fit: where all fit, a split keeps the layout it has
    without offload, none held under the watermark to stream back each step. Qwen3-8B on the RTX
    3090 server, 16 sequences of 4096 tokens: k=3 holds all 128 pages in more than 0.8 of the room
    its weights and working set leave."""
    server = load_machine(REPO / "plans/machines/server-rtx3090-epyc7h12.yaml")
    wl = workload_for(512, 512, 16, context_tokens=4096)
    plain = make_plan(config_path("qwen3-8b"), server, workload=wl)
    offload = make_plan(config_path("qwen3-8b"), server, workload=wl, kv_offload=True)
    k, kv = plain.partition.split_k, plain.kv
    gpu = plain.partition.stages[1]
    room = plain.limits.gpu_budget_bytes - gpu.weight_bytes - gpu_working_bytes(
        plain.ir.units[k:], dtype="bfloat16", batch=16, context=4096, page_size_tokens=512, budget_pages=128,
        device_pages=0, device_page_bytes=kv.device_page_bytes) - stream_ring_bytes(plain.ir.units, k)
    assert kv.device_pages == 128 > 0.8 * room // kv.device_page_bytes   # past the watermark, and fits
    assert offload.partition.split_k == k and (offload.kv.device_pages, offload.kv.host_pages) == (128, 0)
    assert offload.prediction.ms_per_token == plain.prediction.ms_per_token


def test_predict_reevaluates_the_cost_model_at_another_context(laptop_plan_8b):
    p = laptop_plan_8b
    assert predict(p, p.workload.context_tokens) == p.prediction
    longer = predict(p, 8192)
    assert longer.context_tokens == 8192 and longer.ms_per_token > p.prediction.ms_per_token
    assert predict(p, 1024, batch_size=4).tokens_per_s > p.prediction.tokens_per_s


def test_parent_plan_versioning(laptop, laptop_plan_8b):
    from planner.machine import Calibration, DeviceCalibration
    cal = Calibration(cpu=DeviceCalibration(delta_ms_per_block=0.8), cuda=DeviceCalibration(delta_ms_per_block=0.14),
                      provenance="recalibrated", samples=12)
    child = make_plan(config_path("qwen3-8b"), laptop, parent=laptop_plan_8b, calibration=cal,
                      source=rel_source("qwen3-8b"))
    assert child.plan_version == 2 and child.parent_digest == laptop_plan_8b.digest
    cpu = {s.device: s for s in child.prediction.stages}
    assert cpu["cpu"].overhead_ms_per_token == pytest.approx(child.partition.stages[0].num_blocks * 0.8)
    assert child.prediction.ms_per_token == pytest.approx(
        child.prediction.roofline_ms_per_token + 21 * 0.8 + 15 * 0.14, rel=1e-5)


def test_config_digest_fingerprints_architecture_only(tmp_path):
    from transformers import AutoConfig
    data = json.loads(config_path("qwen3-8b").read_text())
    d = config_digest(data)
    assert d == config_digest(config_path("qwen3-8b")) and d.startswith("sha256:") and len(d) == 71
    assert config_digest({**data, "eos_token_id": 7, "torch_dtype": "float16"}) == d
    assert config_digest({**data, "intermediate_size": 12289}) != d
    # re-saved by transformers (rope_theta → rope_parameters, dtype, defaults spelled out): same model
    cfg = AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) != data
    assert config_digest(tmp_path) == d


def test_ttft_is_priced_chunk_by_chunk_like_the_executor():
    """predict_ttft_ms: a prompt of 1300 tokens is three prefill steps (512, 512, 276), each after
    the ones before it, the output projection in the last one only."""
    from dataclasses import replace

    from planner.predict import predict_ttft_ms
    from tests.planner.conftest import DEV

    plan = make_plan(config_path("qwen3-0.6b"), load_machine(DEV), workload=workload_for(512, 16))

    def chunk(n, start, logits):
        p = replace(plan, workload=replace(plan.workload, prompt_tokens=n))
        return predict(p, start + n, 1, prefix_tokens=start, logits=logits).ttft_ms

    expected = chunk(512, 0, False) + chunk(512, 512, False) + chunk(276, 1024, True)
    assert predict_ttft_ms(plan, 1300) == pytest.approx(expected, rel=1e-5)  # each rounded to 6 digits
    # the head (Qwen3-0.6B's tied 311 MB output projection) is read once, not per chunk
    assert chunk(512, 0, True) - chunk(512, 0, False) > 1.0


@pytest.mark.parametrize("machine,model", [("laptop-rtx4060-i7-13700h", "qwen3-8b"),   # streamed steps of 2048
                                           ("helm-dev-2core", "qwen3-0.6b")])            # all on the CPU, chunks
def test_the_plans_ttft_is_what_the_executors_steps_take(machine, model):
    """A workload's prompt longer than a step: the TTFT the search ranks each split by, and the
    plan states, is its prompt in the executor's steps, each priced on its own after the ones
    before it (predict_ttft_ms, which tools/bench_prediction.py and bench_gpu.py compare measured
    TTFTs with), not one step of the whole prompt. Where the prompt streams, those differ by
    more than 1% (each step copies the cached K/V in, the GPU stage's sub-steps pay δ); on the
    CPU alone by less (its chunks cost about what the prompt would at once)."""
    from dataclasses import replace

    from planner.predict import predict_ttft_ms
    from planner.step_shape import prompt_steps

    plan = make_plan(config_path(model), load_machine(REPO / "plans" / "machines" / f"{machine}.yaml"),
                     workload=Workload(prompt_tokens=5000, max_new_tokens=64, context_tokens=8192))
    part = plan.partition
    steps = prompt_steps(5000, part.stream_prefill_min_rows, 512, part.streamed_step_tokens or 512)

    def step(n, start):
        p = replace(plan, workload=replace(plan.workload, prompt_tokens=n))
        return predict(p, start + n, 1, prefix_tokens=start, logits=start + n == 5000).ttft_ms

    assert plan.prediction.ttft_ms == pytest.approx(sum(step(n, start) for start, n in steps), rel=1e-5)
    assert predict_ttft_ms(plan, 5000) == pytest.approx(plan.prediction.ttft_ms, rel=1e-5)  # the plan re-read
    one_step = predict_step(plan, "prefill", 5000, 1, 5000)  # the whole prompt as one step
    gap = abs(sum(ms for ms, _ in one_step.stages) + one_step.link_ms - plan.prediction.ttft_ms)
    if plan.partition.stream_prefill_min_rows:
        assert plan.partition.streamed_step_tokens == 2048  # 3 steps, each crossing the weights
        assert gap > 0.01 * plan.prediction.ttft_ms
    else:
        assert gap < 0.01 * plan.prediction.ttft_ms


def test_a_batchs_prompts_are_priced_in_the_groups_the_engine_steps_them_in():
    """Batch 4 of 2048-token prompts on the CPU: a step holds a 512-token chunk of each (2048
    tokens, the step the plan is priced for), 4 steps each after the ones before it; batch 8:
    two groups of 4 one after the other (the engine gives each sequence a chunk a step, in
    arrival order, as many as a step holds), not 8 sequences of 256 tokens a step."""
    from dataclasses import replace

    from tests.planner.conftest import DEV

    def plan_for(batch):
        return make_plan(config_path("qwen3-0.6b"), load_machine(DEV),
                         workload=workload_for(2048, 64, batch_size=batch, context_tokens=4096))

    four, eight = plan_for(4), plan_for(8)
    chunk = replace(four, workload=replace(four.workload, prompt_tokens=512))
    steps = sum(predict(chunk, s + 512, 4, prefix_tokens=s, logits=s == 1536).ttft_ms for s in range(0, 2048, 512))
    assert four.prediction.ttft_ms == pytest.approx(steps, rel=1e-5)
    assert eight.prediction.ttft_ms == pytest.approx(2 * four.prediction.ttft_ms, rel=1e-5)


def test_the_longest_context_within_a_latency_bound_counts_every_layout_that_meets_it():
    """--max-context --kv-offload --latency-bound: at 16384 tokens the laptop's Qwen3-8B k=24 serves
    the default request soonest with the ring and pages parked (272 ms/token), but every page in
    VRAM without the ring decodes in 264: within a 268 ms bound, so 16384 tokens are within it."""
    m = load_machine(REPO / "plans" / "machines" / "laptop-rtx4060-i7-13700h.yaml")
    unbounded = make_plan(config_path("qwen3-8b"), m, workload=workload_for(context_tokens=16384), kv_offload=True)
    assert unbounded.partition.split_k == 24 and unbounded.kv.host_pages > 0
    assert unbounded.prediction.ms_per_token > 268
    plan = make_plan(config_path("qwen3-8b"), m, kv_offload=True, max_context=True, latency_bound_ms=268)
    assert plan.workload.context_tokens >= 16384
    assert plan.prediction.ms_per_token <= 268


def test_a_forced_split_that_cannot_be_priced_is_refused_even_when_infeasible_is_allowed():
    """A GPU stage on a profile without a GPU has no rates: the plan would have said 0 ms/token,
    and the executor's report would have predicted infinity for it."""
    from tests.planner.conftest import DEV

    with pytest.raises(PlanError, match="--split 10 cannot be priced on .*machine profile has no GPU"):
        make_plan(config_path("qwen3-0.6b"), load_machine(DEV), split_k=10, allow_infeasible=True)
    all_cpu = make_plan(config_path("qwen3-0.6b"), load_machine(DEV), split_k=30, allow_infeasible=True)
    assert all_cpu.prediction.ms_per_token > 0


def test_a_parent_of_another_model_is_refused():
    parent = load_plan(REPO / "plans" / "qwen3-0.6b.helm-dev-2core.yaml")
    with pytest.raises(PlanError, match="--parent is a plan for another model"):
        make_plan(config_path("qwen3-8b"), load_machine(REPO / "plans" / "machines" / "helm-dev-2core.yaml"),
                  parent=parent)


@pytest.mark.parametrize("field,edit", [("kv.watermark", ("watermark: 0.8", "watermark: .nan")),
                                        ("machine.cpu.dram_read_gibps", ("dram_read_gibps: ", "dram_read_gibps: -.inf #"))])
def test_a_number_that_is_not_finite_is_a_plan_error_naming_its_field(field, edit, tmp_path):
    text = (REPO / "plans" / "qwen3-0.6b.helm-dev-2core.yaml").read_text()
    assert edit[0] in text
    path = tmp_path / "plan.yaml"
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(PlanError, match=f"field '{field}': must be a finite number"):
        load_plan(path)


def test_no_split_is_priced_on_rates_too_small_to_give_a_time(tmp_path):
    from tests.planner.conftest import DEV

    text = DEV.read_text()
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("\n".join(line.split(":")[0] + ": 1e-320" if line.strip().startswith("dram_read_gibps:") else line
                              for line in text.splitlines()) + "\n")
    with pytest.raises(PlanError, match="no split of .* can be priced on"):
        make_plan(config_path("qwen3-0.6b"), load_machine(tiny))


def test_a_page_longer_than_the_models_context_is_cut_to_it_as_the_executor_does():
    """Planned at its full length, a page of 100000 tokens did not fit the laptop at all."""
    from tests.planner.conftest import LAPTOP

    plan = make_plan(config_path("qwen3-0.6b"), load_machine(LAPTOP), page_size_tokens=100_000,
                     workload=workload_for(300, 300))
    assert plan.kv.page_size_tokens == 40960


def test_a_streaming_plans_ttft_is_priced_in_its_streamed_steps_and_an_older_plan_in_chunks():
    """predict_ttft_ms follows the executor's steps (planner.step_shape.prompt_steps): a plan that
    streams takes its prompt in steps of its stream_prefill_step_tokens while they reach its
    threshold; a plan from before that field streamed 512 at a time, which is what it reads as."""
    from dataclasses import replace

    from planner.predict import predict_ttft_ms
    from planner.step_shape import PREFILL_CHUNK_TOKENS

    plan = load_plan(REPO / "plans" / "qwen3-8b.laptop-rtx4060.yaml")
    part = plan.partition
    assert part.stream_prefill_min_rows and part.stream_prefill_step_tokens == 1024 == part.streamed_step_tokens

    def step(p, n, start, logits):
        p = replace(p, workload=replace(p.workload, prompt_tokens=n))
        return predict(p, start + n, 1, prefix_tokens=start, logits=logits).ttft_ms

    # 2100 tokens: 1024, 1024, then 52 (over the threshold of 32: streamed too)
    assert predict_ttft_ms(plan, 2100) == pytest.approx(step(plan, 1024, 0, False) + step(plan, 1024, 1024, False)
                                                        + step(plan, 52, 2048, True), rel=1e-5)
    older = replace(plan, partition=replace(part, stream_prefill_step_tokens=None))
    assert older.partition.streamed_step_tokens == PREFILL_CHUNK_TOKENS
    assert predict_ttft_ms(older, 2100) == pytest.approx(sum(step(older, min(512, 2100 - s), s, s + 512 >= 2100)
                                                             for s in range(0, 2100, 512)), rel=1e-5)
    assert predict_ttft_ms(plan, 2100) < 0.7 * predict_ttft_ms(older, 2100)  # 3 crossings of the weights, not 5
    assert replace(part, stream_prefill_min_rows=None).streamed_step_tokens is None
