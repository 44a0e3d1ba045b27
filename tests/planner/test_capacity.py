"""The longest context a plan serves, against a hand computation on a small config, and
`--max-context`, the search that maximizes it (at a latency bound)."""
from __future__ import annotations

import pytest

from planner import cli
from planner.errors import PlanError
from planner.machine import load_machine
from planner.planning import SEARCH_OBJECTIVE, make_plan, workload_for
from planner.predict import predict
from planner.trace import trace_model
from planner.working_set import cpu_working_bytes, gpu_working_bytes

GIB = 2**30

# A small Qwen3 whose sizes are easy to compute by hand (bf16: 2 bytes per parameter).
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "hidden_act": "silu"}
# q 256x256, k and v 256x128, o 256x256, q/k norms 64 each, gate/up/down 256x512, two 256 norms
BLOCK_BYTES = 2 * (256 * 256 + 2 * 256 * 128 + 256 * 256 + 2 * 64 + 3 * 256 * 512 + 2 * 256)
EMBED_BYTES = 2 * 1000 * 256
HEAD_BYTES = 2 * (256 + 1000 * 256)               # final norm + output projection
KV_PER_TOKEN_BLOCK = 2 * 2 * 64 * 2               # K and V, 2 KV heads of 64, bf16
PAGE = 64


def machine(ram_available: int, vram_usable: int | None = None):
    gpu = "" if vram_usable is None else f"""
gpu: {{name: test GPU, vram_total_bytes: {vram_usable + GIB}, vram_usable_bytes: {vram_usable}, hbm_gibps: 100,
      prefill_gflops: 1000}}
link: {{h2d_gibps: 10, h2d_latency_us: 10, d2h_latency_us: 10}}"""
    return load_machine(f"""
name: tiny-box
cpu: {{model_name: test CPU, cores: 2, dram_read_gibps: 10, compute_gflops: 100, ram_total_bytes: {4 * GIB},
      ram_available_bytes: {ram_available}}}{gpu}
""")


def cpu_work(pages: int, batch: int = 1, k: int = 6) -> int:
    """The CPU stage's working set (units [0, k)) at a context of `pages` pages, as
    planner/working_set.py prices it (tests/planner/test_working_set.py)."""
    units = trace_model(TINY).units
    return cpu_working_bytes(units[:k], dtype="bfloat16", batch=batch, context=pages * PAGE,
                             page_size_tokens=PAGE, budget_pages=batch * pages, gpu_units=units[k:])


def test_the_tiny_config_traces_to_the_hand_computed_sizes():
    plan = make_plan(TINY, machine(GIB), workload=workload_for(16, 16), page_size_tokens=PAGE)
    units = plan.ir.units
    assert [u.weight_bytes for u in units] == [EMBED_BYTES] + [BLOCK_BYTES] * 4 + [HEAD_BYTES]
    assert [u.kv_bytes_per_token for u in units] == [0] + [KV_PER_TOKEN_BLOCK] * 4 + [0]


def test_all_cpu_longest_context_is_the_host_ram_left_after_the_weights():
    weights = EMBED_BYTES + 4 * BLOCK_BYTES + HEAD_BYTES
    page_bytes = PAGE * 4 * KV_PER_TOKEN_BLOCK               # one page over the 4 blocks
    batch = 2
    ram = weights + batch * 10 * page_bytes + cpu_work(10, batch) + 1000   # 10 pages per sequence, and not 11
    assert weights + batch * 11 * page_bytes + cpu_work(11, batch) > ram
    plan = make_plan(TINY, machine(ram), workload=workload_for(16, 16, batch), page_size_tokens=PAGE)
    lc = plan.longest_context
    assert plan.partition.split_k == 6 and lc.batch_size == batch and lc.model_max_tokens == 4096
    assert lc.without_offload_tokens == 10 * PAGE and "host needs" in lc.without_offload_bound
    assert (lc.with_offload_tokens, lc.with_offload_bound) == (lc.without_offload_tokens, lc.without_offload_bound)
    assert f"Longest context at batch 2: {10 * PAGE} tokens" in plan.to_yaml()


def test_a_split_longest_context_with_and_without_kv_offload():
    # k = 3: embedding + 2 blocks on the CPU; 2 blocks + head on the GPU, which also works in the
    # VRAM planner/working_set.py prices (tests/planner/test_working_set.py), growing with the context
    gpu_weights, cpu_weights = 2 * BLOCK_BYTES + HEAD_BYTES, EMBED_BYTES + 2 * BLOCK_BYTES
    page = PAGE * 2 * KV_PER_TOKEN_BLOCK                      # one page over a stage's 2 blocks
    gpu_units = trace_model(TINY).units[3:]

    def work(pages, device_pages):                            # at a context of `pages` pages, batch 1
        return gpu_working_bytes(gpu_units, dtype="bfloat16", batch=1, context=pages * PAGE, page_size_tokens=PAGE,
                                 budget_pages=pages, device_pages=device_pages, device_page_bytes=page)

    vram = gpu_weights + 7 * page + work(7, 7) + 100          # room for 7 device pages
    ram = cpu_weights + 40 * page + cpu_work(20, k=3) + 100   # 40 pages of host memory beside a working set
    plan = make_plan(TINY, machine(ram, vram), workload=workload_for(16, 16), page_size_tokens=PAGE, split_k=3)
    lc = plan.longest_context
    # without offload: every GPU-stage page in VRAM (7 fit) and as many CPU-stage pages on the host (40 fit)
    assert gpu_weights + 8 * page + work(8, 8) > vram
    assert lc.without_offload_tokens == 7 * PAGE and "usable VRAM" in lc.without_offload_bound

    # with offload: the most pages under 0.8 of the room left after weights and working set that
    # fit beside the working set they grow stay in VRAM; P pages per sequence need P CPU-stage pages
    # and the rest parked on the host, all within the 40 pages of host memory. Here a longer context
    # grows the working set (a prompt chunk's mask over it) faster than parking pages frees VRAM:
    # this model's GPU stage has 2 blocks of 2 KV heads, so offload cannot serve more. (Qwen3-8B on
    # the laptop, 15 GPU blocks: tests/planner/test_plan.py.)
    def device_pages(pages):
        room = vram - gpu_weights - work(pages, 0)
        return max((d for d in range(pages + 1) if d <= 0.8 * room // page
                    and gpu_weights + d * page + work(pages, d) <= vram), default=-1)

    def serves(pages):                 # offload needs 2 device pages: one written, one streamed back
        d = device_pages(pages)
        return (d >= 2 or d == pages) and cpu_weights + (2 * pages - d) * page + cpu_work(pages, k=3) <= ram

    longest = max(p for p in range(1, 64) if serves(p))
    assert lc.with_offload_tokens == longest * PAGE == lc.without_offload_tokens
    assert "usable VRAM" in lc.with_offload_bound


def test_the_model_position_limit_caps_the_longest_context():
    plan = make_plan(TINY, machine(2 * GIB), workload=workload_for(16, 16), page_size_tokens=PAGE)
    lc = plan.longest_context
    assert lc.without_offload_tokens == 4096 and "max_position_embeddings (4096)" in lc.without_offload_bound


def test_max_context_plans_at_the_longest_context_within_a_latency_bound():
    weights = EMBED_BYTES + 4 * BLOCK_BYTES + HEAD_BYTES
    ram = weights + 10 * PAGE * 4 * KV_PER_TOKEN_BLOCK + cpu_work(10) + 1000
    box = machine(ram)
    longest = make_plan(TINY, box, workload=workload_for(16, 16), page_size_tokens=PAGE, max_context=True)
    assert longest.workload.context_tokens == 10 * PAGE == longest.prediction.context_tokens
    assert "the longest context any split serves" in longest.search.objective
    # a bound between the predicted step at 5 and at 6 pages: 5 pages
    five, six = (predict(longest, n * PAGE).ms_per_token for n in (5, 6))
    assert five < six
    bounded = make_plan(TINY, box, workload=workload_for(16, 16), page_size_tokens=PAGE, max_context=True,
                        latency_bound_ms=(five + six) / 2)
    assert bounded.workload.context_tokens == 5 * PAGE
    with pytest.raises(PlanError, match="the fastest split that fits one page, k=6, predicts"):
        make_plan(TINY, box, workload=workload_for(16, 16), page_size_tokens=PAGE, max_context=True,
                  latency_bound_ms=five / 100)
    with pytest.raises(PlanError, match=r"shorter than prompt \+ new tokens \(512 \+ 512\)"):
        make_plan(TINY, box, workload=workload_for(512, 512), page_size_tokens=PAGE, max_context=True)


def test_context_alone_adapts_the_default_workload(tmp_path, capsys):
    from tests.planner.conftest import LAPTOP, config_path

    out = tmp_path / "p.yaml"
    assert cli.main(["plan", str(config_path("qwen3-0.6b")), "--machine", str(LAPTOP), "--context", "128",
                     "-o", str(out)]) == 0
    w = load_plan_workload(out)
    assert (w.prompt_tokens, w.max_new_tokens, w.context_tokens) == (64, 64, 128)
    assert cli.main(["plan", str(config_path("qwen3-0.6b")), "--machine", str(LAPTOP), "--context", "300",
                     "--max-new-tokens", "10", "-o", str(out)]) == 0
    w = load_plan_workload(out)
    assert (w.prompt_tokens, w.max_new_tokens, w.context_tokens) == (290, 10, 300)
    capsys.readouterr()
    assert cli.main(["plan", str(config_path("qwen3-0.6b")), "--machine", str(LAPTOP), "--context", "100",
                     "--prompt-tokens", "200"]) == 2
    assert "--context 100 is shorter than prompt + new tokens (200 + 0)" in capsys.readouterr().err
    assert cli.main(["plan", str(config_path("qwen3-0.6b")), "--machine", str(LAPTOP), "--context", "100",
                     "--max-context"]) == 2


def load_plan_workload(path):
    from planner.plan import load_plan
    return load_plan(path).workload


def test_a_context_beyond_the_models_limit_is_refused():
    with pytest.raises(PlanError, match=r"--context 5000 is longer than the model's max_position_embeddings \(4096\)"):
        make_plan(TINY, machine(2 * GIB), workload=workload_for(16, 16, context_tokens=5000), page_size_tokens=PAGE)


def test_a_recalibrated_max_context_plan_does_not_claim_the_old_bound():
    from planner.machine import Calibration, DeviceCalibration
    from planner.planning import replan

    weights = EMBED_BYTES + 4 * BLOCK_BYTES + HEAD_BYTES
    box = machine(weights + 10 * PAGE * 4 * KV_PER_TOKEN_BLOCK + cpu_work(10) + 1000)
    plan = make_plan(TINY, box, workload=workload_for(16, 16), page_size_tokens=PAGE, max_context=True,
                     latency_bound_ms=1e6)
    assert "within 1e+06 ms/token" in plan.search.objective
    slower = replan(plan, Calibration(cpu=DeviceCalibration(delta_ms_per_block=5.0)), None)
    assert slower.workload.context_tokens == plan.workload.context_tokens
    assert slower.search.objective.startswith(SEARCH_OBJECTIVE) and \
        "under that plan's calibration" in slower.search.objective


def test_a_latency_bounded_plan_keeps_its_bound_where_the_request_favours_a_slower_decode(laptop):
    """--max-context --latency-bound: the context is the longest a split serves within the bound,
    and the plan's split is the best among those within it. Qwen3-8B on the laptop at 16k tokens:
    the request favours k=25 (its prompt streamed) over k=24's faster decode; a bound between the
    two keeps the plan's decode within it, where the unbounded search at the same context is not."""
    from tests.planner.conftest import config_path

    at_16k = make_plan(config_path("qwen3-8b"), laptop, workload=workload_for(512, 512, context_tokens=16384))
    cands = {c.split_k: c for c in at_16k.search.candidates}
    k = at_16k.partition.split_k
    assert cands[k - 1].feasible and cands[k - 1].total_ms < cands[k].total_ms  # the request chose k
    bound = (cands[k - 1].total_ms + cands[k].total_ms) / 2
    bounded = make_plan(config_path("qwen3-8b"), laptop, max_context=True, latency_bound_ms=bound)
    assert bounded.prediction.ms_per_token <= bound
    unbounded = make_plan(config_path("qwen3-8b"), laptop, workload=bounded.workload)
    assert unbounded.prediction.ms_per_token > bound  # the bound made the difference
