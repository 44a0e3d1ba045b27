"""Search properties (hypothesis): the chosen split is feasible and serves the workload's request
fastest; tighter VRAM never moves units from the CPU to the GPU."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.search import SearchSpace, best_split, evaluate_all
from planner.units import GIB, MIB
from tests.planner.helpers import machine, model_units, with_vram

# derandomized: CI runs the same examples every time (run with more examples locally to explore)
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, offload=None):
    L = draw(st.integers(1, 12))
    units, shared = model_units(
        L, block_bytes=draw(st.integers(1 * MIB, 2 * GIB)), emb_bytes=draw(st.integers(MIB, GIB)),
        head_bytes=draw(st.integers(MIB, GIB)), kv=draw(st.sampled_from([0, 1024, 4096, 65536])),
        act=draw(st.sampled_from([2048, 8192])), attn=draw(st.sampled_from([0, 4096, 16384])),
        tied=draw(st.booleans()))
    m = machine(cpu_gibps=draw(st.floats(1, 200)), cpu_gflops=draw(st.floats(10, 5000)),
                l3_bytes=draw(st.sampled_from([0, 8 * MIB, 300 * MIB])), l3_gibps=draw(st.floats(1, 600)),
                hbm_gibps=draw(st.floats(50, 4000)), gpu_gflops=draw(st.floats(1e3, 1e6)),
                link_gibps=draw(st.floats(1, 64)), latency_us=draw(st.floats(0, 50)),
                delta_cpu=draw(st.sampled_from([0.0, 0.8])), delta_gpu=draw(st.sampled_from([0.0, 0.14])),
                flash_attention=draw(st.sampled_from([None, True])))  # True: prompt steps may stream
    space = SearchSpace(batch=draw(st.integers(1, 8)), context=draw(st.integers(1, 32768)),
                        prompt=draw(st.integers(1, 2048)), page_size_tokens=draw(st.sampled_from([16, 512])),
                        watermark=draw(st.sampled_from([0.5, 0.8, 1.0])),
                        offload=draw(st.booleans()) if offload is None else offload,
                        gpu_budget_bytes=draw(st.integers(0, 40 * GIB)),
                        host_budget_bytes=draw(st.integers(0, 64 * GIB)),
                        dtype=draw(st.sampled_from([None, "bfloat16"])))  # half precision: streamable
    return units, shared, m, space


@st.composite
def streaming_problems(draw, offload=None):
    """Models and GPUs where the CPU stage's prompt steps stream (flash attention, bf16, a CPU
    much slower than the GPU) and the VRAM is near what the weights need: where the streamed
    steps' ring and the KV pages compete for it, and the request and decode alone rank apart."""
    L, block = draw(st.integers(4, 12)), draw(st.integers(128 * MIB, 512 * MIB))
    units, shared = model_units(L, block_bytes=block, emb_bytes=64 * MIB, head_bytes=64 * MIB,
                                kv=draw(st.sampled_from([4096, 16384])))
    budget = int((L * block + 128 * MIB) * draw(st.floats(0.2, 1.1)))
    m = machine(cpu_gibps=draw(st.floats(20, 100)), cpu_gflops=draw(st.floats(50, 500)), l3_bytes=8 * MIB,
                hbm_gibps=draw(st.floats(200, 3000)), gpu_gflops=draw(st.floats(2e4, 4e5)),
                link_gibps=draw(st.floats(8, 64)), vram_usable=budget, flash_attention=True)
    space = SearchSpace(batch=draw(st.integers(1, 4)), context=draw(st.sampled_from([2048, 8192, 16384])),
                        prompt=draw(st.sampled_from([128, 512, 2048])), page_size_tokens=512, watermark=0.8,
                        offload=draw(st.booleans()) if offload is None else offload, gpu_budget_bytes=budget,
                        host_budget_bytes=64 * GIB, dtype="bfloat16")
    return units, shared, m, space


@SETTINGS
@given(st.one_of(problems(), streaming_problems()), st.integers(1, 4096))
def test_chosen_split_is_feasible_and_fastest(problem, new_tokens):
    """Fastest for the workload's request: its prompt, then a decode step per further token (which
    also picks each split's layout where KV offload gives it a choice)."""
    units, shared, m, space = problem
    cands = evaluate_all(units, shared, m, replace(space, new_tokens=new_tokens, prompt_in_steps=True))
    assert [c.split_k for c in cands] == list(range(len(units) + 1))
    best = best_split(cands, new_tokens)
    feasible = [c for c in cands if c.feasible]
    if best is None:
        assert not feasible
        return
    assert best.feasible
    fastest = min(c.ttft_ms + (new_tokens - 1) * c.ms for c in feasible)  # the workload's request
    assert best.request_ms(new_tokens) == fastest
    assert best.split_k == max(c.split_k for c in feasible if c.request_ms(new_tokens) == fastest)  # ties: larger k


@SETTINGS
@given(problems(), st.floats(0.0, 1.0), st.integers(1, 4096))
def test_tighter_vram_never_moves_units_to_the_gpu(problem, shrink, new_tokens):
    """Also with KV offload, where a tighter budget slows GPU attention (more pages streamed).
    Not where prompt steps stream (streaming_problems): the ring competes for the VRAM there, and
    the choice may move either way (planner/search.py)."""
    units, shared, m, space = problem
    space = replace(space, new_tokens=new_tokens, prompt_in_steps=True)  # as the planner's search sets it
    tight_budget = int(space.gpu_budget_bytes * shrink)
    loose = best_split(evaluate_all(units, shared, m, space), new_tokens)
    tight = best_split(evaluate_all(units, shared, with_vram(m, tight_budget),
                                    replace(space, gpu_budget_bytes=tight_budget)), new_tokens)
    if tight is not None:
        assert loose is not None, "a looser budget lost a feasible split"
        assert tight.split_k >= loose.split_k


@SETTINGS
@given(st.one_of(problems(offload=False), streaming_problems(offload=False)), st.integers(1, 4096))
def test_offload_never_slows_a_split_that_fits_without_it(problem, new_tokens):
    """--kv-offload lets pages that do not fit park on the host; where they all fit, a split serves
    the workload's request no slower than without offload: with the layout it has without it
    (none parked under the watermark to stream back), or with the ring, or larger streamed steps,
    beside pages parked where that serves the request sooner. An existing plan's evaluation (no new-token count) keeps
    the layout it has without offload."""
    units, shared, m, space = problem
    space = replace(space, prompt_in_steps=True)
    without = evaluate_all(units, shared, m, space)
    allowed = evaluate_all(units, shared, m, replace(space, offload=True))
    ranked = evaluate_all(units, shared, m, replace(space, offload=True, new_tokens=new_tokens))
    for plain, offload, best in zip(without, allowed, ranked):
        if plain.feasible:
            assert offload.feasible and offload.kv.host_pages == 0
            assert (offload.ms, offload.kv.device_pages) == (plain.ms, plain.kv.device_pages)
            assert best.feasible and best.request_ms(new_tokens) <= plain.request_ms(new_tokens)
            if best.kv.host_pages == 0:
                assert (best.ms, best.kv.device_pages) == (plain.ms, plain.kv.device_pages)
            else:  # parked pages bought the ring, or larger streamed steps: a prompt that starts sooner
                assert best.stream_prefill_min_rows is not None and (
                    plain.stream_prefill_min_rows is None
                    or best.stream_prefill_step_tokens > plain.stream_prefill_step_tokens)


def test_no_gpu_means_all_cpu_or_nothing():
    units, shared = model_units(4, 100 * MIB, 10 * MIB, 10 * MIB)
    space = SearchSpace(batch=1, context=1024, prompt=16, page_size_tokens=512, watermark=0.8, offload=False,
                        gpu_budget_bytes=0, host_budget_bytes=GIB)
    best = best_split(evaluate_all(units, shared, machine(gpu=False), space), 512)
    assert best.split_k == len(units)
    space = SearchSpace(**{**space.__dict__, "host_budget_bytes": MIB})
    assert best_split(evaluate_all(units, shared, machine(gpu=False), space), 512) is None
