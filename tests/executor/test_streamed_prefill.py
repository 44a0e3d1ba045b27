"""A CPU stage's prompt steps run with their weights streamed to the GPU (executor/streamed_prefill.py).

Without CUDA the same code runs with CPU tensors for the device: its piece-by-piece products,
the K/V it copies out of and back into the stage's pages, and the attention over a sequence's
cached keys are what these tests hold to transformers' tokens (tests/executor/test_cuda.py runs
it on a GPU).
"""
from dataclasses import replace

import pytest
import torch

from executor.batch import StepBatch
from executor.engine import Engine
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.request_params import SamplingParams, StopCriteria
from executor.stage import Stage
from executor.streamed_prefill import StreamedPrefill
from tests.executor.helpers import hf_greedy, prompt_ids

FAMILIES = ["qwen3", "llama", "qwen2", "mistral"]


def count_streamed_steps(monkeypatch) -> list[int]:
    """The token counts of the steps the streamed path runs, from here on (a test whose tokens the
    CPU kernels would give as well must show the streamed path ran)."""
    steps, run = [], StreamedPrefill.__call__
    monkeypatch.setattr(StreamedPrefill, "__call__", lambda self, x, b: (steps.append(b.num_tokens), run(self, x, b))[1])
    return steps


def streamed_engine(path, split, min_rows, page_size=8, piece_bytes=None, backend="auto", **engine_kw):
    cfg = ModelConfig.from_dir(path)
    placement = replace(Placement.from_split(cfg.num_units, split, page_size_tokens=page_size),
                        stream_prefill_min_rows=min_rows)
    placement.validate()
    model = load_model(path, placement, cfg, backend=backend, streamed_prefill=True)
    streamed = model.stages[0].streamed
    if piece_bytes is not None:  # pieces of a few rows: every projection crosses in several
        streamed.piece_bytes = piece_bytes
    return Engine(model, eos_token_ids=(), **engine_kw), streamed


@pytest.mark.parametrize("arch", FAMILIES)
def test_streamed_prompt_steps_give_transformers_tokens(checkpoint, arch, monkeypatch):
    """fp32, CPU stage of embedding + 2 blocks streamed, prompt in chunks of 16 over pages of 8:
    later chunks attend over keys the first wrote back into the pages; decode then runs the CPU
    kernels over those pages."""
    path = checkpoint(arch, "fp32")
    prompt = prompt_ids(40, 256, seed=21)
    want = hf_greedy(path, prompt, 10)
    engine, streamed = streamed_engine(path, split=3, min_rows=2, piece_bytes=1024, prefill_chunk=16, stream_chunk=16)
    assert streamed is not None and len(streamed.blocks) == 2
    steps = count_streamed_steps(monkeypatch)
    seq = engine.generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=10, ignore_eos=True))[0]
    assert steps == [16, 16, 8]  # every chunk streamed, the decodes not
    assert seq.output_ids == want


def test_only_steps_of_min_rows_stream(checkpoint, monkeypatch):
    """Steps below the threshold (decode, a short last chunk) run on the stage's own kernels; each
    projection crosses in pieces of whole rows, as many as its bytes need."""
    path = checkpoint("qwen3", "fp32")
    engine, streamed = streamed_engine(path, split=2, min_rows=8, piece_bytes=4096, prefill_chunk=16, stream_chunk=16)
    steps, pieces = [], []
    run, upload = StreamedPrefill.__call__, StreamedPrefill._upload
    monkeypatch.setattr(StreamedPrefill, "__call__", lambda self, x, b: (steps.append(b.num_tokens), run(self, x, b))[1])
    monkeypatch.setattr(StreamedPrefill, "_upload", lambda self, w: (pieces.append(w.shape[0]), upload(self, w))[1])
    prompt = prompt_ids(37, 256, seed=22)  # chunks of 16, 16 and 5 tokens
    seq = engine.generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=4, ignore_eos=True))[0]
    assert steps == [16, 16]
    assert seq.output_ids == hf_greedy(path, prompt, 4)
    block = streamed.blocks[0]  # one block: units 0..1 on the CPU
    per_step = []
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = getattr(block, name).weight.shape
        rows = max(1, 4096 // (k * 4))
        per_step += [rows] * (n // rows) + ([n % rows] if n % rows else [])
    assert pieces == per_step * 2


def test_a_batch_of_prompts_and_decodes_streams_together(checkpoint, monkeypatch):
    """Two prompts whose chunks share steps with the other's decodes: each sequence attends over
    its own pages only, and the tokens equal each prompt run alone without streaming."""
    path = checkpoint("llama", "fp32")
    prompts = [prompt_ids(30, 256, seed=23), prompt_ids(12, 256, seed=24)]
    stop = StopCriteria(max_new_tokens=8, ignore_eos=True)
    engine, _ = streamed_engine(path, split=2, min_rows=4, prefill_chunk=8, stream_chunk=16)
    steps = count_streamed_steps(monkeypatch)
    got = [s.output_ids for s in engine.generate(prompts, SamplingParams(), stop)]
    # 16 of the first; its last 14 with the second's first 2; the second's last 10 with the first's decode
    assert steps == [16, 16, 11]
    assert got == [hf_greedy(path, p, 8) for p in prompts]


def record_stage_steps(monkeypatch) -> dict[int, list[int]]:
    """The token counts of each stage's forward calls (by its first unit), from here on."""
    calls: dict[int, list[int]] = {}
    run = Stage.forward
    monkeypatch.setattr(Stage, "forward", lambda self, x, b: (calls.setdefault(self.unit_start, []).append(
        b.num_tokens), run(self, x, b))[1])
    return calls


@pytest.mark.parametrize("arch,min_rows,streamed_steps,cpu_steps,gpu_steps", [
    ("qwen3", 20, [32], [32, 8, 4], [8, 8, 8, 8, 8, 4]),     # the 12 tokens left fall short of 20
    ("mistral", 20, [32], [32, 8, 4], [8, 8, 8, 8, 8, 4]),
    ("qwen3", 4, [32, 12], [32, 12], [8, 8, 8, 8, 8, 4]),     # both stream: the second over cached pages
    ("llama", 4, [32, 12], [32, 12], [8, 8, 8, 8, 8, 4]),
])
def test_a_long_prompt_streams_in_large_steps_which_the_gpu_stage_takes_in_priced_sub_steps(
        checkpoint, arch, min_rows, streamed_steps, cpu_steps, gpu_steps, monkeypatch):
    """A streaming load's prompt goes in steps of stream_chunk tokens (one crossing of the weights
    each), not of prefill_chunk; the stage after the streaming one is priced for prefill_chunk
    per sequence and takes them in sub-steps of that, each attending over the K/V the ones before
    it wrote. A last chunk short of the threshold runs on the CPU's kernels in chunks of
    prefill_chunk: the steps are planner.step_shape.prompt_steps'. The streamed path makes its
    fp32 values 5 rows at a time: queries in blocks over keys in pages of 8, its own among them."""
    from planner.step_shape import prompt_steps

    path = checkpoint(arch, "fp32")
    prompt = prompt_ids(44, 256, seed=27)
    engine, streamed = streamed_engine(path, split=3, min_rows=min_rows, piece_bytes=2048, prefill_chunk=8,
                                       stream_chunk=32)
    streamed.row_block = 5
    streamed_counts, stages = count_streamed_steps(monkeypatch), record_stage_steps(monkeypatch)
    seq = engine.generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=5, ignore_eos=True))[0]
    assert seq.output_ids == hf_greedy(path, prompt, 5)
    assert [n for _, n in prompt_steps(44, min_rows, chunk=8, stream_chunk=32)] == cpu_steps
    assert streamed_counts == streamed_steps
    assert stages[0] == cpu_steps + [1] * 4
    assert stages[3] == gpu_steps + [1] * 4


def test_a_step_splits_into_sub_steps_that_keep_its_rows_in_order():
    batch = StepBatch.build([("a", 40, 1), ("b", 0, 20), ("c", 7, 1), ("d", 3, 9)], logit_rows=[0, 20, 21, 30])
    subs = batch.split(max_rows=10, max_slice=8)
    assert [(first, end) for first, end, _ in subs] == [(0, 9), (9, 17), (17, 22), (22, 30), (30, 31)]
    assert [[(s.seq_id, s.start, s.count, s.offset) for s in sub.slices] for _, _, sub in subs] == [
        [("a", 40, 1, 0), ("b", 0, 8, 1)], [("b", 8, 8, 0)], [("b", 16, 4, 0), ("c", 7, 1, 4)], [("d", 3, 8, 0)],
        [("d", 11, 1, 0)]]  # d's second piece waits for a sub-step of its own
    assert [sub.logit_rows.tolist() for _, _, sub in subs] == [[0], [], [3, 4], [], [0]]
    assert torch.equal(torch.cat([sub.positions for _, _, sub in subs]), batch.positions)
    with pytest.raises(ValueError, match="ascend"):
        StepBatch.build([("a", 0, 2), ("b", 0, 2)], logit_rows=[3, 1]).split(2, 2)


@pytest.mark.parametrize("batch, prompt, max_rows, max_slice, riders", [
    (1, 2048, 512, 512, 0), (1, 2048, 2048, 512, 0), (4, 512, 2048, 512, 0), (3, 700, 2048, 512, 0),
    (2, 1000, 1024, 512, 0), (5, 37, 64, 16, 0), (1, 1, 8, 8, 0), (7, 300, 512, 128, 0), (2, 2048, 512, 512, 0),
    (1, 2045, 512, 512, 3), (1, 2047, 512, 512, 1), (1, 1024, 2048, 512, 6), (2, 600, 1024, 512, 4)])
def test_the_planners_sub_step_count_is_the_executors(batch, prompt, max_rows, max_slice, riders):
    """planner.step_shape.sub_steps, which prices a streamed step's GPU stage a per-block overhead
    per sub-step, counts the sub-steps StepBatch.split makes of such a step, the decodes riding
    along first, as the engine schedules them."""
    from planner.step_shape import sub_steps

    decodes = [(f"d{i}", 100 + i, 1) for i in range(riders)]
    step = StepBatch.build(decodes + [(f"s{i}", 0, prompt) for i in range(batch)], logit_rows=[])
    assert sub_steps(batch, prompt, max_rows, max_slice, riders) == len(step.split(max_rows, max_slice))


def test_bf16_streamed_prefill_is_as_close_to_transformers_as_the_cpu_kernels(checkpoint):
    """bf16: the prompt's logits with the CPU stage's blocks streamed stay within the suite's bf16
    tolerance of transformers' fp32 logits (tests/executor/test_correctness.py), as the stage's
    own kernels do; on CUDA, where the streamed products take bf16 inputs as the GPU stage's do,
    no further than transformers' own bf16 model there."""
    from tests.executor.helpers import hf_model
    path = checkpoint("qwen3", "bf16")
    prompt = prompt_ids(24, 256, seed=25)
    with torch.no_grad():
        want = hf_model(path, torch.float32)(torch.tensor([prompt])).logits[0, -1]
        bound = 1.25
        if torch.cuda.is_available():
            half = hf_model(path, torch.bfloat16).cuda()
            own = (half(torch.tensor([prompt]).cuda()).logits[0, -1].float().cpu() - want).abs().max().item()
            bound = max(bound, own)
    error = {}
    for min_rows in (None, 1):
        engine, streamed = streamed_engine(path, split=3, min_rows=min_rows)
        assert (streamed is not None) == (min_rows is not None)
        first = []
        run = engine._run_stages
        engine._run_stages = lambda ids, batch: (first.append(run(ids, batch)), first[-1])[1]
        engine.generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=1, ignore_eos=True))
        error[min_rows] = (first[0][0][-1].cpu() - want).abs().max().item()  # the first step's logits
    assert error[1] <= bound and error[None] <= 1.25, (error, bound)


def test_the_stage_without_a_policy_streams_nothing(checkpoint):
    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, Placement.from_split(cfg.num_units, 3), cfg, streamed_prefill=True)
    assert model.stages[0].streamed is None


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_streaming_plan_streams_only_where_cuda_and_flash_attention_are(checkpoint, dtype):
    """Streaming to a GPU that is not there would run the CPU stage's prompt steps in PyTorch on
    the same CPU, slower than its kernels; on a GPU whose flash attention does not take the model's
    attention (fp32) they would build masks the plan did not price: by default neither streams
    (a test asks with streamed_prefill=True). The model says which policy it runs."""
    from planner.profile import flash_attention_runs

    path = checkpoint("qwen3", dtype)
    cfg = ModelConfig.from_dir(path)
    placement = replace(Placement.from_split(cfg.num_units, 3), stream_prefill_min_rows=4)
    model = load_model(path, placement, cfg)
    runs = torch.cuda.is_available() and flash_attention_runs(torch.device("cuda"), cfg.dtype, cfg.num_heads,
                                                             cfg.num_kv_heads, cfg.head_dim)
    assert (model.stages[0].streamed is not None) == runs
    assert model.stream_prefill == (4 if runs else False)


def test_a_refused_page_lock_leaves_the_prompt_steps_on_the_cpu(checkpoint, monkeypatch, caplog):
    """Page-locking the CPU stage's weights can be refused (a locked-memory limit): the plan loads
    and serves, its prompt steps on the CPU, and the log says why."""
    from executor import loader

    def refuse(*args, **kwargs):
        raise MemoryError("could not page-lock 4096 bytes of host memory for weights streamed to the GPU")

    monkeypatch.setattr(loader, "StreamedPrefill", refuse)
    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    placement = replace(Placement.from_split(cfg.num_units, 3), stream_prefill_min_rows=4)
    with caplog.at_level("WARNING"):
        model = load_model(path, placement, cfg, streamed_prefill=True)
    assert model.stages[0].streamed is None and "they run on the CPU" in caplog.text
    prompt = prompt_ids(12, 256, seed=26)
    seq = Engine(model, eos_token_ids=()).generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=3, ignore_eos=True))[0]
    assert seq.output_ids == hf_greedy(path, prompt, 3)


def test_a_streamed_policy_needs_a_positive_row_count():
    from executor.errors import PlacementError
    with pytest.raises(PlacementError, match="at least 1 token"):
        replace(Placement.from_split(6, 3), stream_prefill_min_rows=0).validate()


def test_decode_steps_stay_on_the_cpu_however_many_sequences_they_hold(checkpoint, monkeypatch):
    """Eight sequences decoding together make steps of 8 tokens, at the threshold; they are not
    prompt chunks, so they run on the stage's kernels. Each prompt's own chunk streams."""
    path = checkpoint("qwen3", "fp32")
    engine, _ = streamed_engine(path, split=2, min_rows=8, prefill_chunk=16)
    steps = []
    run = StreamedPrefill.__call__
    monkeypatch.setattr(StreamedPrefill, "__call__",
                        lambda self, x, b: (steps.append(sorted(s.count for s in b.slices)), run(self, x, b))[1])
    prompts = [prompt_ids(9, 256, seed=40 + i) for i in range(8)]
    seqs = engine.generate(prompts, SamplingParams(), StopCriteria(max_new_tokens=6, ignore_eos=True))
    assert steps and all(max(counts) > 1 for counts in steps)  # every streamed step carried a prompt chunk
    assert [s.output_ids for s in seqs] == [hf_greedy(path, p, 6) for p in prompts]


def test_the_engine_takes_its_streamed_step_size_from_the_placement(checkpoint, monkeypatch):
    """A plan's stream_prefill_step_tokens reaches the engine through its placement (a plan from
    before it: a prompt chunk), and a placement refuses a step of no tokens."""
    from executor.errors import PlacementError
    from planner.step_shape import PREFILL_CHUNK_TOKENS

    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    placement = replace(Placement.from_split(cfg.num_units, 2, page_size_tokens=8), stream_prefill_min_rows=4,
                        stream_prefill_step_tokens=20)
    model = load_model(path, placement, cfg, streamed_prefill=True)
    steps = count_streamed_steps(monkeypatch)
    prompt = prompt_ids(50, 256, seed=28)
    seq = Engine(model, eos_token_ids=(), prefill_chunk=8).generate(
        [prompt], SamplingParams(), StopCriteria(max_new_tokens=3, ignore_eos=True))[0]
    assert steps == [20, 20, 10] and seq.output_ids == hf_greedy(path, prompt, 3)
    older = replace(placement, stream_prefill_step_tokens=None)
    assert Engine(load_model(path, older, cfg, streamed_prefill=True)).stream_chunk == PREFILL_CHUNK_TOKENS
    with pytest.raises(PlacementError, match="at least 1 token"):
        replace(placement, stream_prefill_step_tokens=0).validate()
    with pytest.raises(PlacementError, match="from 40 tokens but take at most 20: none would stream"):
        replace(placement, stream_prefill_min_rows=40).validate()
    with pytest.raises(PlacementError, match=f"take at most {PREFILL_CHUNK_TOKENS}"):  # a plan from before the field
        replace(placement, stream_prefill_min_rows=600, stream_prefill_step_tokens=None).validate()


def test_a_streaming_loads_step_holds_no_more_than_its_streamed_step_is_priced_for(checkpoint, monkeypatch):
    """Several prompts streamed together: the step holds the plan's stream_prefill_step_tokens at
    most (its memory is priced for that many rows, planner/working_set.streamed_step_bytes),
    however many more the stages' own steps would take."""
    path = checkpoint("qwen3", "fp32")
    engine, _ = streamed_engine(path, split=2, min_rows=4, prefill_chunk=8, stream_chunk=16)
    steps = count_streamed_steps(monkeypatch)
    prompts = [prompt_ids(16, 256, seed=50 + i) for i in range(4)]
    seqs = engine.generate(prompts, SamplingParams(), StopCriteria(max_new_tokens=3, ignore_eos=True))
    assert steps and max(steps) == 16 and sum(steps) >= 64
    assert [s.output_ids for s in seqs] == [hf_greedy(path, p, 3) for p in prompts]


def test_a_chunk_retried_alone_below_the_threshold_runs_in_priced_chunks(checkpoint, monkeypatch):
    """A failed batched step is retried sequence by sequence: a chunk that streamed only beside
    another's falls short of the threshold alone, so it runs on the CPU stage's kernels, cut to
    the prompt chunk they are priced for; the tokens are still transformers'."""
    path = checkpoint("qwen3", "fp32")
    engine, _ = streamed_engine(path, split=2, min_rows=40, prefill_chunk=8, stream_chunk=64)
    run, failed = StreamedPrefill.__call__, []

    def fail_once(self, x, b):
        if not failed:
            failed.append(b.num_tokens)
            raise RuntimeError("a streamed step failed")
        return run(self, x, b)

    monkeypatch.setattr(StreamedPrefill, "__call__", fail_once)
    stages = record_stage_steps(monkeypatch)
    prompts = [prompt_ids(30, 256, seed=60 + i) for i in range(2)]
    seqs = engine.generate(prompts, SamplingParams(), StopCriteria(max_new_tokens=3, ignore_eos=True))
    assert failed == [60]
    assert stages[0][:3] == [60, 8, 8]  # the batched step, then each alone, cut to a chunk of 8
    assert [s.output_ids for s in seqs] == [hf_greedy(path, p, 3) for p in prompts]


def test_a_step_larger_than_a_stage_is_priced_for_reaches_it_in_sub_steps(checkpoint):
    """Engine._forward: a stage other than the streaming one takes a step of more tokens than its
    priced step, or a slice longer than a prompt chunk, in consecutive sub-steps within both, and
    its outputs are the step's rows in order."""
    path = checkpoint("qwen3", "fp32")
    engine, _ = streamed_engine(path, split=2, min_rows=4, prefill_chunk=8)
    engine.priced_step_tokens = 10
    seen = []

    class Stage:
        streamed = None

        def forward(self, x, batch):
            seen.append([(s.seq_id, s.start, s.count) for s in batch.slices])
            return x[batch.logit_rows] * 10

    batch = StepBatch.build([("a", 0, 6), ("b", 0, 6), ("c", 4, 1)], logit_rows=[5, 11, 12])
    out = engine._forward(Stage(), torch.arange(13, dtype=torch.float32), batch)
    assert seen == [[("a", 0, 6)], [("b", 0, 6), ("c", 4, 1)]]
    assert out.tolist() == [50.0, 110.0, 120.0]
    seen.clear()
    engine._forward(Stage(), torch.arange(12, dtype=torch.float32), StepBatch.build([("a", 0, 12)]))
    assert seen == [[("a", 0, 8)], [("a", 8, 4)]]


def test_a_step_short_of_the_threshold_is_cut_to_the_priced_step_beside_its_decodes(checkpoint):
    """Engine._unstreamed_within_price: prompt chunks that will not stream are cut to the prompt
    chunk and to what the priced step leaves beside the running sequences' decodes."""
    path = checkpoint("qwen3", "fp32")
    engine, _ = streamed_engine(path, split=2, min_rows=40, prefill_chunk=8, stream_chunk=64)
    engine.priced_step_tokens = 10
    running = [object(), object(), object()]
    engine.running = running
    prompt, later = object(), object()
    schedule = [(s, 5, 1) for s in running] + [(prompt, 0, 30), (later, 0, 6)]
    assert engine._unstreamed_within_price(schedule) == [(s, 5, 1) for s in running] + [(prompt, 0, 7)]
    streams = [(s, 5, 1) for s in running] + [(prompt, 0, 40)]
    assert engine._unstreamed_within_price(streams) == streams  # it reaches the threshold: as scheduled


def test_a_short_prompt_behind_a_long_one_starts_beside_it(checkpoint, monkeypatch):
    """A streaming load gives every waiting prompt a prefill_chunk first and only then grows the
    chunks up to stream_chunk: a short request behind a long one gets its first token from the
    first step, not once the long prompt is done."""
    path = checkpoint("qwen3", "fp32")
    engine, _ = streamed_engine(path, split=2, min_rows=4, prefill_chunk=8, stream_chunk=32)
    steps = count_streamed_steps(monkeypatch)
    stop = StopCriteria(max_new_tokens=3, ignore_eos=True)
    long, short = prompt_ids(150, 256, seed=70), prompt_ids(5, 256, seed=71)
    first, second = (engine.add_request(p, SamplingParams(), stop) for p in (long, short))
    engine.step()
    assert len(second.output_ids) == 1 and not first.output_ids
    assert steps == [32]  # the long prompt's 8, the short one's 5, the long one's grown by 19
    assert first.num_computed == 27
    while engine.has_work():
        engine.step()
    assert first.output_ids == hf_greedy(path, long, 3) and second.output_ids == hf_greedy(path, short, 3)


def test_query_blocks_after_cached_keys_at_any_offset_give_transformers_tokens(checkpoint, monkeypatch):
    """Streamed steps of 19 tokens over pages of 8, their fp32 values made 5 rows at a time: every
    step after a prompt's first starts mid-page, and its 4 blocks of queries attend over the one
    copy of the cached keys (the last cached page partly filled) and their own; the other
    prompt's decodes ride along in later steps. Tokens as transformers' for each prompt alone."""
    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(50, 256, seed=41), prompt_ids(23, 256, seed=42)]
    engine, streamed = streamed_engine(path, split=3, min_rows=4, prefill_chunk=8, stream_chunk=19)
    streamed.row_block = 5
    starts, run = [], StreamedPrefill.__call__
    monkeypatch.setattr(StreamedPrefill, "__call__", lambda self, x, b: (
        starts.append(sorted((s.start, s.count) for s in b.slices)), run(self, x, b))[1])
    got = [s.output_ids for s in engine.generate(prompts, SamplingParams(),
                                                 StopCriteria(max_new_tokens=6, ignore_eos=True))]
    assert got == [hf_greedy(path, p, 6) for p in prompts]
    chunks = [(start, n) for step in starts for start, n in step if n > 1]
    assert any(start % 8 and n > 10 for start, n in chunks), starts  # mid-page, several query blocks
    assert any(len(step) > 1 and any(n == 1 for _, n in step) for step in starts), starts  # a decode along
