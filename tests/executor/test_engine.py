"""Engine lifecycle: stopping rules, abort, and requests joining a running batch."""
import dataclasses

import pytest

from executor.engine import Engine
from executor.errors import RequestError
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.request_params import SamplingParams, StopCriteria
from tests.executor.helpers import budget_engine, helm_generate, pages_in_use, prompt_ids


def engine_for(path, split=2, device_kv_pages=None, page_size=4, **kw):
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, split, page_size_tokens=page_size, device_kv_pages=device_kv_pages)
    return Engine(load_model(path, placement, cfg), **kw)


@pytest.fixture
def path(checkpoint):
    return checkpoint("qwen3", "fp32")


def test_stops_at_eos_and_at_caller_stop_ids(path):
    prompt = prompt_ids(9, 256, seed=20)
    free_run, _ = helm_generate(path, [prompt], max_new_tokens=12)
    target = free_run[0][5]
    first = free_run[0].index(target)  # the token may also occur earlier
    eng = engine_for(path, eos_token_ids=(target,))
    seq = eng.generate([prompt], stop=StopCriteria(max_new_tokens=12))[0]
    assert seq.output_ids == free_run[0][:first + 1] and seq.finish_reason == "stop"
    eng = engine_for(path, eos_token_ids=(target,))
    seq = eng.generate([prompt], stop=StopCriteria(max_new_tokens=12, ignore_eos=True))[0]
    assert seq.output_ids == free_run[0] and seq.finish_reason == "length"
    eng = engine_for(path, eos_token_ids=())
    seq = eng.generate([prompt], stop=StopCriteria(max_new_tokens=12, stop_token_ids=(target,)))[0]
    assert seq.output_ids == free_run[0][:first + 1] and seq.finish_reason == "stop"


def test_abort_frees_pages_at_once_and_others_continue(path):
    eng = engine_for(path, split=1, device_kv_pages=4, eos_token_ids=())
    stop = StopCriteria(max_new_tokens=20, ignore_eos=True)
    a = eng.add_request(prompt_ids(15, 256, seed=21), stop=stop)
    b = eng.add_request(prompt_ids(6, 256, seed=22), stop=stop)
    for _ in range(5):
        eng.step()
    before = pages_in_use(eng)
    assert eng.abort(a.request_id)
    assert a.finish_reason == "aborted"
    assert pages_in_use(eng) < before and a.request_id not in eng.model.stages[1].kv.sequences()
    while eng.has_work():
        eng.step()
    assert pages_in_use(eng) == 0
    alone, _ = helm_generate(path, [b.prompt_ids], split=1, max_new_tokens=20, page_size=4, device_kv_pages=4)
    assert b.output_ids == alone[0]
    assert not eng.abort(a.request_id)  # already gone


def test_requests_joining_mid_run_get_their_own_tokens(path):
    prompts = [prompt_ids(n, 256, seed=30 + n) for n in (5, 17, 9)]
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    alone = [helm_generate(path, [p], split=2, sampling=sampling, max_new_tokens=10, page_size=4)[0][0] for p in prompts]
    eng = engine_for(path, eos_token_ids=())
    stop = StopCriteria(max_new_tokens=10, ignore_eos=True)
    seqs = [eng.add_request(prompts[0], sampling, stop)]
    for _ in range(3):
        eng.step()
    seqs.append(eng.add_request(prompts[1], sampling, stop))  # joins a running batch
    eng.step()
    seqs.append(eng.add_request(prompts[2], sampling, stop))
    while eng.has_work():
        eng.step()
    assert [s.output_ids for s in seqs] == alone


def test_greedy_and_sampled_rows_of_one_step_get_their_own_tokens(path):
    """Greedy rows take their argmax where the logits are, top-k rows one topk over them all there,
    the others are filtered on the host: in one batch, in any mix (top-k rows of different k), each
    request gets the tokens it gets alone."""
    prompts = [prompt_ids(n, 256, seed=60 + n) for n in (7, 4, 11, 5, 9)]
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=5), SamplingParams(),
              SamplingParams(temperature=1.1, top_k=3, top_p=0.9, seed=6), SamplingParams(temperature=0.8, seed=7)]
    alone = [helm_generate(path, [p], split=2, sampling=s, max_new_tokens=8, page_size=4)[0][0]
             for p, s in zip(prompts, params)]
    assert alone[1] != helm_generate(path, [prompts[1]], split=2, max_new_tokens=8, page_size=4)[0][0]
    eng = engine_for(path, eos_token_ids=())
    stop = StopCriteria(max_new_tokens=8, ignore_eos=True)
    seqs = [eng.add_request(p, s, stop) for p, s in zip(prompts, params)]
    while eng.has_work():
        eng.step()
    assert [s.output_ids for s in seqs] == alone


def test_a_request_failing_to_sample_leaves_its_batch_mates_tokens_as_they_are_alone(path, monkeypatch):
    """A row whose sampling fails fails the step, retried one sequence at a time: the seeded rows
    drawn before it draw again then, and still get the tokens they get alone."""
    from executor import sampling

    first, second = prompt_ids(6, 256, seed=80), prompt_ids(5, 256, seed=81)
    good = SamplingParams(temperature=0.9, seed=5)
    alone = helm_generate(path, [first], split=2, sampling=good, max_new_tokens=6, page_size=4)[0][0]
    candidates = sampling.candidates

    def failing(logits, params):
        if params.seed == 99:
            raise ValueError("the logits are not finite: nothing to sample from")
        return candidates(logits, params)

    monkeypatch.setattr(sampling, "candidates", failing)
    eng = engine_for(path, eos_token_ids=())
    stop = StopCriteria(max_new_tokens=6, ignore_eos=True)
    a = eng.add_request(first, good, stop)
    b = eng.add_request(second, SamplingParams(temperature=0.9, seed=99), stop)
    while eng.has_work():
        eng.step()
    assert b.finish_reason == "error" and "not finite" in b.error
    assert a.finish_reason == "length" and a.output_ids == alone


def test_request_validation(path):
    eng = engine_for(path)
    eng.add_request([11, 12], request_id="x")
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request([11], request_id="x")
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([])
    with pytest.raises(RequestError, match="vocabulary"):
        eng.add_request([11, -1])
    with pytest.raises(RequestError, match="temperature"):
        eng.add_request([11], SamplingParams(temperature=-1))
    assert len(eng.waiting) == 1  # rejected requests leave no trace


def test_timings_are_recorded_per_stage(path):
    eng = engine_for(path, split=3)
    eng.generate([[11, 12, 13]], stop=StopCriteria(max_new_tokens=3))
    rec = eng.last_step
    assert [t.stage for t in rec.stages] == [0, 1] and all(t.ms > 0 for t in rec.stages)
    assert (rec.phase, rec.batch, rec.tokens, rec.context) == ("decode", 1, 1, 5)   # token 5 attends over 5


def test_a_step_is_announced_once_its_device_work_is_queued_before_the_host_waits_for_it(path, monkeypatch):
    """Engine.on_launched gets the step's record, its times not yet known, after the stages ran
    and before the sampler reads their logits (a GPU stage may still be computing); on_step then
    gets the same record with its times."""
    import executor.engine as engine_module

    order = []
    sample_rows = engine_module.sample_rows
    monkeypatch.setattr(engine_module, "sample_rows", lambda *a: (order.append("sampled"), sample_rows(*a))[1])
    eng = engine_for(path, split=3, eos_token_ids=())
    eng.on_launched = lambda step: order.append(("launched", step))
    eng.on_step = lambda step: order.append(("step", step))
    eng.generate([prompt_ids(5, 256, seed=72)], stop=StopCriteria(max_new_tokens=3, ignore_eos=True))
    assert [e if isinstance(e, str) else e[0] for e in order] == ["launched", "sampled", "step"] * 3
    for launched, step in zip(order[0::3], order[2::3]):
        assert launched[1].stages == () and len(step[1].stages) == 2
        assert launched[1] == dataclasses.replace(step[1], stages=())
    assert [e[1].phase for e in order[0::3]] == ["prefill", "decode", "decode"]


def test_a_failing_measurement_fails_no_request_and_a_failed_draw_is_still_measured(path, monkeypatch):
    """The hooks measure; they do not decide tokens. A hook that raises is logged, and the seeded
    requests draw what they draw without it (a retry after the sampler moved their generators would
    draw anew); a step whose logits give no token (not finite) was run, and is measured."""
    import executor.engine as engine_module

    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    stop = StopCriteria(max_new_tokens=4, ignore_eos=True)
    prompts = [prompt_ids(5, 256, seed=73), prompt_ids(3, 256, seed=74)]
    want = [s.output_ids for s in engine_for(path, split=3, eos_token_ids=()).generate(prompts, params, stop)]
    eng = engine_for(path, split=3, eos_token_ids=())
    eng.on_launched = eng.on_step = lambda step: 1 / 0
    got = eng.generate(prompts, params, stop)
    assert [s.output_ids for s in got] == want and all(s.finish_reason == "length" for s in got)

    recorded = []
    eng = engine_for(path, split=3, eos_token_ids=())
    eng.on_step = recorded.append

    def not_finite(*args):
        raise ValueError("logits are not finite")

    monkeypatch.setattr(engine_module, "sample_rows", not_finite)
    seq = eng.generate([prompts[0]], SamplingParams(), stop)[0]
    assert seq.finish_reason == "error" and [r.phase for r in recorded] == ["prefill"]
    assert len(recorded[0].stages) == 2 and all(t.ms > 0 for t in recorded[0].stages)


def test_a_step_record_says_what_its_prediction_needs(path):
    """Prompt chunks make a prefill step (their count, tokens and mean end); decodes a decode step
    (sequences, mean context through the new token)."""
    eng = engine_for(path, split=3, eos_token_ids=(), prefill_chunk=4)
    stop = StopCriteria(max_new_tokens=3, ignore_eos=True)
    eng.add_request(prompt_ids(6, 256, seed=70), stop=stop)
    eng.add_request(prompt_ids(3, 256, seed=71), stop=stop)
    eng.step()                                         # chunks [0, 4) and [0, 3)
    assert (eng.last_step.phase, eng.last_step.batch, eng.last_step.tokens, eng.last_step.context) == \
        ("prefill", 2, 7, round((4 + 3) / 2))
    assert (eng.last_step.riders, eng.last_step.rider_context, eng.last_step.streamed) == (0, 0, False)
    eng.step()                                         # the 6-token prompt's last 2; the other decodes
    assert (eng.last_step.phase, eng.last_step.batch, eng.last_step.tokens, eng.last_step.context) == \
        ("prefill", 1, 2, 6)
    # the decode riding along attends over the other prompt's 3 cached tokens: one whole page of
    # them copied, where the step streams
    assert eng.page_size == 4 and (eng.last_step.riders, eng.last_step.rider_context) == (1, 4)
    eng.step()                                         # both decode: contexts 7 and 5
    assert (eng.last_step.phase, eng.last_step.batch, eng.last_step.tokens, eng.last_step.context) == \
        ("decode", 2, 2, 6)


def test_a_failing_request_ends_alone(path, monkeypatch):
    """A step that fails because of one sequence is retried per sequence: only that one errors."""
    eng = engine_for(path, eos_token_ids=())
    stop = StopCriteria(max_new_tokens=6, ignore_eos=True)
    good = eng.add_request(prompt_ids(8, 256, seed=40), stop=stop)
    bad = eng.add_request(prompt_ids(5, 256, seed=41), stop=stop)
    stage = eng.model.stages[0]
    real_forward = stage.forward

    def forward(x, batch):
        if any(s.seq_id == bad.request_id and s.start + s.count > 7 for s in batch.slices):
            raise RuntimeError("simulated kernel failure")
        return real_forward(x, batch)

    monkeypatch.setattr(stage, "forward", forward)
    while eng.has_work():
        eng.step()
    assert bad.finish_reason == "error" and "simulated kernel failure" in bad.error
    assert good.finish_reason == "length"
    alone, _ = helm_generate(path, [good.prompt_ids], split=2, max_new_tokens=6, page_size=4)
    assert good.output_ids == alone[0]
    assert pages_in_use(eng) == 0


def test_admission_follows_the_plans_kv_budget(path):
    """Issue 11: sequences start only while the pages they may grow to fit the plan's budget, in
    arrival order; one that could never fit is refused before it starts; the pools never hold more."""
    eng = budget_engine(path, sequences=2, context=8, device_kv_pages=2)   # 4 pages: 2 in "VRAM", 2 on the host
    assert [s.kv.device_pool.capacity_pages for s in eng.model.stages] == [4, 2]
    assert eng.model.stages[1].kv.host_pool.capacity_pages == 2
    with pytest.raises(RequestError, match="the context holds 8"):
        eng.add_request(prompt_ids(8, 256, seed=50))
    stop = StopCriteria(max_new_tokens=4, ignore_eos=True)           # 4 + 4 tokens: 2 pages each
    seqs = [eng.add_request(prompt_ids(4, 256, seed=51 + i), stop=stop) for i in range(3)]
    eng.step()
    assert {s.request_id for s in eng.running} | {s.request_id for s in eng.waiting if s.num_computed} == \
        {seqs[0].request_id, seqs[1].request_id}                     # the third waits for pages
    assert seqs[2].num_computed == 0 and eng.kv_pages_reserved == 4
    most = 0
    while eng.has_work():
        eng.step()
        most = max(most, pages_in_use(eng) // len(eng.model.stages))
        assert eng.kv_pages_reserved <= 4
    assert most <= 4 and pages_in_use(eng) == 0 and eng.kv_pages_reserved == 0
    for seq in seqs:                                                 # and the tokens are what they are alone
        alone, _ = helm_generate(path, [seq.prompt_ids], split=2, max_new_tokens=4, page_size=4)
        assert seq.finish_reason == "length" and seq.output_ids == alone[0]


def test_the_plans_context_bounds_every_sequence(path):
    eng = budget_engine(path, sequences=1, context=10)
    seq = eng.generate([prompt_ids(7, 256, seed=60)], stop=StopCriteria(max_new_tokens=50, ignore_eos=True))[0]
    assert seq.finish_reason == "context" and seq.num_tokens == 10
    with pytest.raises(RequestError, match="the context holds 10"):
        eng.add_request(prompt_ids(10, 256, seed=61))


def test_an_out_of_memory_step_fails_its_request_and_the_engine_serves_on(path, monkeypatch):
    """An allocation that fails mid-step (torch.cuda.OutOfMemoryError is a RuntimeError; the KV
    pools raise MemoryError) ends that request, frees its pages, and the next requests run."""
    eng = budget_engine(path, sequences=2, context=16)
    stage = eng.model.stages[1]
    real_forward, calls = stage.forward, []

    def forward(x, batch):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("simulated: out of memory")
        return real_forward(x, batch)

    monkeypatch.setattr(stage, "forward", forward)
    stop = StopCriteria(max_new_tokens=6, ignore_eos=True)
    first = eng.add_request(prompt_ids(5, 256, seed=62), stop=stop)
    while eng.has_work():
        eng.step()
    assert first.finish_reason == "error" and "out of memory" in first.error
    assert pages_in_use(eng) == 0 and eng.kv_pages_reserved == 0
    second = eng.generate([prompt_ids(5, 256, seed=63)], stop=stop)[0]
    alone, _ = helm_generate(path, [second.prompt_ids], split=2, max_new_tokens=6, page_size=4)
    assert second.finish_reason == "length" and second.output_ids == alone[0]


def test_started_sequences_count_against_the_running_batch(path):
    """A sequence counts against max_running from its first prompt chunk, not from its first
    token: the GPU stage's working set and decode graphs are priced for that many at once."""
    eng = engine_for(path, max_running=2, prefill_chunk=4)
    stop = StopCriteria(max_new_tokens=3, ignore_eos=True)
    seqs = [eng.add_request(prompt_ids(10, 256, seed=60 + i), stop=stop) for i in range(5)]  # 3 chunks each
    most = 0
    while eng.has_work():
        eng.step()
        started = [s for s in seqs if s.num_computed and s.finish_reason is None]
        most = max(most, len(started))
        assert len(started) <= 2 and len(eng.running) <= 2
    assert most == 2 and all(s.finish_reason == "length" for s in seqs)


def test_a_plans_step_is_bounded_by_its_batch_of_prompt_chunks_where_a_gpu_stage_runs(path):
    from dataclasses import replace

    from planner.step_shape import MAX_STEP_TOKENS, step_tokens

    cfg = ModelConfig.from_dir(path)
    for split, want in ((2, step_tokens(3, 64)), (cfg.num_units, MAX_STEP_TOKENS)):
        placement = replace(Placement.from_split(cfg.num_units, split, page_size_tokens=4),
                            kv_sequences=3, context_tokens=64)
        assert Engine(load_model(path, placement, cfg)).max_step_tokens == want
    assert step_tokens(3, 64) == 192


def test_an_engine_runs_no_more_sequences_than_its_plans_working_sets_are_priced_for(path):
    """A plan's working sets (logits, decode rows, a GPU stage's graphs) are priced for the
    sequences its KV budget holds in its own pages, at most MAX_RUNNING_SEQUENCES
    (planner/working_set.py): an engine runs no more at once, under a larger --max-batch or with a
    smaller page than the plan's (more pages, so more short sequences the budget would admit).
    Without a plan a GPU stage runs MAX_RUNNING_SEQUENCES (its graphs' rows), the CPU what it is given."""
    from planner.planning import plan_for_split, workload_for
    from planner.step_shape import MAX_RUNNING_SEQUENCES

    from executor.plan_io import placement_for

    cfg = ModelConfig.from_dir(path)
    for split, want in ((2, MAX_RUNNING_SEQUENCES), (cfg.num_units, 4 * MAX_RUNNING_SEQUENCES)):
        placement = Placement.from_split(cfg.num_units, split, page_size_tokens=4)
        assert Engine(load_model(path, placement, cfg), max_running=4 * MAX_RUNNING_SEQUENCES).max_running == want
    # a plan for 1 sequence of 64 tokens in pages of 32: priced for 2 sequences, in pages of 4 too
    plan = plan_for_split(path, 2, page_size_tokens=32, workload=workload_for(32, 32))
    placement = placement_for(plan, cfg, page_size_tokens=4)
    assert (placement.kv_budget_pages, placement.max_running) == (16, 2)
    eng = Engine(load_model(path, placement, cfg))
    assert eng.max_running == 2
    stop = StopCriteria(max_new_tokens=2, ignore_eos=True)
    seqs = [eng.add_request(prompt_ids(3, 256, seed=70 + i), stop=stop) for i in range(6)]
    while eng.has_work():
        eng.step()
        assert len([s for s in seqs if s.num_computed and s.finish_reason is None]) <= 2
    assert all(s.finish_reason == "length" for s in seqs)
    cpu_plan = plan_for_split(path, cfg.num_units, page_size_tokens=32, workload=workload_for(32, 32))
    assert Engine(load_model(path, placement_for(cpu_plan, cfg, page_size_tokens=4), cfg)).max_running == 2


def test_a_sequence_whose_pages_cannot_be_freed_still_ends_and_the_step_is_not_run_again(path, monkeypatch,
                                                                                        caplog):
    """Once a step's tokens are drawn they are committed: a sequence whose ending cannot free its
    pages ends all the same (logged), and the one batched with it gets each token once (the
    failure used to re-run the drawn step sequence by sequence: a second token for one, no event
    for the other)."""
    eng = engine_for(path)
    stop = StopCriteria(max_new_tokens=3, ignore_eos=True)
    short = eng.add_request(prompt_ids(6, 256, seed=64), stop=StopCriteria(max_new_tokens=1, ignore_eos=True))
    other = eng.add_request(prompt_ids(7, 256, seed=65), stop=stop)
    real_free = eng.model.free_sequence

    def free_sequence(seq_id):
        if seq_id == short.request_id:
            raise RuntimeError("simulated: freeing its pages failed")
        real_free(seq_id)

    monkeypatch.setattr(eng.model, "free_sequence", free_sequence)
    events = eng.step()  # both prefill together; `short` ends at its first token
    assert [(e.request_id, e.finish_reason) for e in events] == [(short.request_id, "length"),
                                                                 (other.request_id, None)]
    assert len(short.output_ids) == 1 and "freeing its KV pages failed" in caplog.text
    while eng.has_work():
        eng.step()
    alone, _ = helm_generate(path, [other.prompt_ids], split=2, max_new_tokens=3, page_size=4)
    assert other.output_ids == alone[0]
