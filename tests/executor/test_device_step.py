"""The GPU stage's static-shape decode step (executor/device_step.py), run eagerly on the CPU: the
code and padded shapes a CUDA graph captures, against transformers and the streaming path
(executor/attention.py) on the same checkpoints. tests/executor/test_cuda.py replays it as graphs."""
import json
from pathlib import Path

import pytest
import torch

from executor import attention
from executor import engine as engine_module
from executor.device_step import PAGED_DECODE_ENV, ResidentDecode
from planner.step_shape import MAX_RUNNING_SEQUENCES, bucket
from executor.engine import Engine
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.request_params import SamplingParams, StopCriteria
from tests.executor.helpers import (decode_step_launches, helm_generate, helm_teacher_forced_logits, hf_greedy, hf_model,
                                    prompt_ids)
from tests.executor.test_correctness import FAMILIES, LOGIT_TOL


@pytest.fixture
def static_steps(monkeypatch):
    """The (rows, 3 + pages) index shape of every static step taken."""
    shapes = []
    step = ResidentDecode.step

    def spy(self, x, index):
        shapes.append(tuple(index.shape))
        return step(self, x, index)

    monkeypatch.setattr(ResidentDecode, "step", spy)
    return shapes


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


@pytest.mark.parametrize("arch", FAMILIES)
def test_static_decode_matches_transformers_greedy(checkpoint, arch, static_steps):
    path = checkpoint(arch, "fp32")
    prompt = prompt_ids(20, 256, seed=1)
    want = hf_greedy(path, prompt, 24)
    got, model = helm_generate(path, [prompt], split=1, max_new_tokens=24, page_size=8, device_kv_pages=8,
                               backend="torch", kv_slab=True)
    assert isinstance(model.stages[1].fused, ResidentDecode)
    assert got[0] == want
    # Every decode step after the first token took the static step; positions 20..42 span 3..6 pages.
    assert len(static_steps) == 23
    assert {rows for rows, _ in static_steps} == {1}
    assert {cols - 3 for _, cols in static_steps} == {4, 8}


def test_padded_batches_equal_the_streaming_path(checkpoint, static_steps):
    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(n, 256, seed=n) for n in (3, 17, 9)]  # 3 rows: a padded row in a bucket of 4
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7)
    for sampling in (None, seeded):
        want, _ = helm_generate(path, prompts, split=1, sampling=sampling, max_new_tokens=20, page_size=4,
                                device_kv_pages=40, backend="torch", kv_slab=False)
        static_steps.clear()
        got, model = helm_generate(path, prompts, split=1, sampling=sampling, max_new_tokens=20, page_size=4,
                                   device_kv_pages=40, backend="torch", kv_slab=True)
        assert got == want
        assert (4, 3 + 8) in static_steps  # three sequences padded to four rows, up to 8 pages each
        kv = model.stages[1].kv.stats()
        assert kv.evictions == 0 and kv.device_pages_used == 0  # all freed at the end


def test_evicted_pages_fall_back_to_streaming(checkpoint, static_steps):
    path = checkpoint("llama", "fp32")
    prompt = prompt_ids(5, 256, seed=11)
    want, _ = helm_generate(path, [prompt], max_new_tokens=24)  # all on the CPU
    got, model = helm_generate(path, [prompt], split=1, max_new_tokens=24, page_size=4, device_kv_pages=3,
                               backend="torch", kv_slab=True)
    assert got == want
    # Static while the sequence's 2-3 pages are resident (positions 5..11), streaming once one is evicted.
    assert len(static_steps) == 7
    assert model.stages[1].kv.stats().evictions > 3


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_bf16_static_decode_within_transformers_own_bf16_error(checkpoint, arch, static_steps):
    path = checkpoint(arch, "bf16")
    ids = prompt_ids(52, 256, seed=2)
    with torch.no_grad():
        want = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0].float()
        own_err = (hf_model(path, torch.bfloat16)(torch.tensor([ids])).logits[0].float() - want).abs().max().item()
    got = helm_teacher_forced_logits(path, ids, prefill=20, split=1, backend="torch", device_kv_pages=4,
                                     kv_slab=True)
    assert len(static_steps) == 32  # every decode step; the 20-token prefill is op by op
    err = (got - want).abs().max().item()
    print(f"{arch} bf16 static step: max |logit diff| {err:.3f}, transformers' own bf16 {own_err:.3f}")
    assert err < LOGIT_TOL["bf16"] and err < own_err


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_chunked_prompt_on_the_fused_prompt_path_matches_transformers(checkpoint, arch, static_steps):
    """The GPU stage's prompt chunks gather their pages for PyTorch's fused attention; later
    chunks (start > 0) take the offset causal mask, across pages."""
    path = checkpoint(arch, "fp32")
    prompt = prompt_ids(45, 256, seed=21)
    want = hf_greedy(path, prompt, 8)
    got, model = helm_generate(path, [prompt], split=1, max_new_tokens=8, page_size=8, device_kv_pages=8,
                               backend="torch", kv_slab=True, prefill_chunk=16)
    assert model.stages[1].attention.fused_prompt
    assert got[0] == want and len(static_steps) == 7


@pytest.mark.parametrize("arch,dtype,lengths", [("qwen3", "fp32", (3, 17, 9)), ("llama", "fp32", (3, 17, 9)),
                                                ("qwen3", "bf16", (3, 17, 9)), ("qwen3", "fp16", (3, 17, 9)),
                                                ("qwen3", "fp32", (70,))])
def test_paged_decode_kernels_match_transformers_and_the_sdpa_step(checkpoint, arch, dtype, lengths, static_steps,
                                                                   monkeypatch):
    """HELM_PAGED_DECODE=1: decode attention by executor/paged_decode.py's kernels over the slab's
    pages (here under Triton's interpreter), with padded rows (3 sequences in a bucket of 4) and
    pages partly written, or one long sequence whose keys split in two. fp32: the tokens of
    transformers. bf16 and fp16 (whose blocks multiply in half precision, as on a GPU): every
    decode step's logits within the dtype's tolerance of the SDPA step's, both fed the SDPA run's
    tokens (two roundings of one attention may part at a near tie and then go separate ways)."""
    from executor import paged_decode

    if paged_decode.unsupported(16, 16, 1, torch.device("cpu")):
        pytest.skip(paged_decode.unsupported(16, 16, 1, torch.device("cpu")))
    path = checkpoint(arch, dtype)
    prompts = [prompt_ids(n, 256, seed=n) for n in lengths]
    logits = {}  # each step's logits [sequences, V] per path (every sequence emits at every step here)
    real_sample_rows = engine_module.sample_rows

    def run(path_name, forced=None):
        logits[path_name] = []

        def spy(rows, *args, **kwargs):
            logits[path_name].append(rows.detach().float().cpu())
            drawn = real_sample_rows(rows, *args, **kwargs)
            step = len(logits[path_name]) - 1
            return drawn if forced is None else [tokens[step] for tokens in forced]

        monkeypatch.setattr(engine_module, "sample_rows", spy)
        return helm_generate(path, prompts, split=1, max_new_tokens=14, page_size=16, device_kv_pages=12,
                             backend="torch", kv_slab=True)

    want = [hf_greedy(path, p, 14) for p in prompts] if dtype == "fp32" else run("sdpa")[0]
    monkeypatch.setenv(PAGED_DECODE_ENV, "1")
    static_steps.clear()
    got, model = run("paged", forced=None if dtype == "fp32" else want)
    step = model.stages[1].fused
    assert step.paged and got == want
    if dtype != "fp32":
        decode_steps = list(zip(logits["sdpa"], logits["paged"]))[1:]  # (the first: the prompts, not paged)
        assert len(decode_steps) == 13 and all(ref.shape == new.shape == (len(prompts), ref.shape[1])
                                               for ref, new in decode_steps)
        err = max((ref - new).abs().max().item() for ref, new in decode_steps)
        assert err < LOGIT_TOL[dtype], f"{dtype}: paged decode's logits {err:.3f} from SDPA's"
    if len(lengths) == 3:
        assert (4, 3 + 2) in static_steps
    else:  # 70..83 tokens: 8 pages of 16 in the bucket, two blocks of 64 keys, one split each
        assert (1, 3 + 8) in static_steps and paged_decode.splits_for(1, 2, 128, step._processors)[1] == 2


def test_stale_kv_in_masked_slots_is_never_read(checkpoint, static_steps):
    """Slots after a sequence's end, padded pages and the scratch slot hold whatever earlier
    sequences left (here: large finite values in every slot); the position mask hides them all."""
    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(n, 256, seed=n) for n in (3, 17, 9)]
    want, _ = helm_generate(path, prompts, max_new_tokens=12)
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, 1, page_size_tokens=4, device_kv_pages=40)
    model = load_model(path, placement, cfg, backend="torch", kv_slab=True)
    model.stages[1].kv.device_pool.slab.fill_(1e4)
    seqs = Engine(model).generate(prompts, SamplingParams(), StopCriteria(max_new_tokens=12, ignore_eos=True))
    assert [s.output_ids for s in seqs] == want and static_steps


def test_a_failed_requests_non_finite_kv_never_reaches_the_next_sequence_on_its_pages(checkpoint, static_steps):
    """A request whose K/V went non-finite (an overflowed activation) fails; a later sequence that
    takes its pages writes only the slots up to its own position, and a masked slot still enters
    SDPA as 0 · V: released slab pages are zeroed, so its tokens are those it gets on a fresh pool."""
    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, 1, page_size_tokens=16, device_kv_pages=4)
    model = load_model(path, placement, cfg, backend="torch", kv_slab=True)
    engine = Engine(model)
    poisoned = engine.add_request(prompt_ids(20, 256, seed=4), stop=StopCriteria(max_new_tokens=8, ignore_eos=True))
    engine.step()  # its prompt: then every slot of its pages as an overflow would leave them
    kv = model.stages[1].kv
    kv.device_pool.slab[kv.device_slots(poisoned.request_id)] = float("nan")
    while engine.has_work():
        engine.step()
    assert poisoned.finish_reason == "error"
    prompt = prompt_ids(5, 256, seed=9)
    want, _ = helm_generate(path, [prompt], split=1, max_new_tokens=12, page_size=16, device_kv_pages=4,
                            backend="torch", kv_slab=True)
    static_steps.clear()
    later = engine.generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=12, ignore_eos=True))[0]
    assert later.finish_reason != "error" and [later.output_ids] == want and static_steps
    assert not kv.device_pool.slab.isnan().any()  # every page released zeroed


@pytest.mark.parametrize("flash", [True, False])
def test_prompt_chunks_of_a_sequence_longer_than_the_pool_take_flash_attention_a_page_at_a_time(
        checkpoint, static_steps, monkeypatch, flash):
    """The GPU stage gathers a prompt's pages for the fused attention only while the sequence is
    no longer than the device pool (3 pages of 8 tokens); a longer one's chunks take flash
    attention a page at a time, the pages back one at a time (segmented_prompt_attention), each
    after its cached keys; where flash attention does not run, they stream (streaming_attention).
    Tokens as transformers' either way."""
    path = checkpoint("llama", "fp32")
    prompt = prompt_ids(45, 256, seed=31)
    want = hf_greedy(path, prompt, 6)
    gathered, segmented, streamed = [], [], []
    fused, by_pages, streaming = (attention.fused_prompt_attention, attention.segmented_prompt_attention,
                                  attention.streaming_attention)

    def spy(*args, **kw):
        gathered.append(args[1].shape[1])  # the keys gathered
        return fused(*args, **kw)

    def pages_spy(q, cached, own_k, own_v, start, scale):
        cached = list(cached)
        segmented.append((start, sum(k.shape[1] for k, _, _ in cached), q.shape[0]))
        return by_pages(q, cached, own_k, own_v, start, scale)

    monkeypatch.setattr(attention, "fused_prompt_attention", spy)
    monkeypatch.setattr(attention, "segmented_prompt_attention", pages_spy)
    monkeypatch.setattr(attention, "streaming_attention",
                        lambda q, *a, **kw: (streamed.append(q.shape[0]), streaming(q, *a, **kw))[1])
    if not flash:  # as where the profile says flash attention does not run: the plan's flash_attention False
        monkeypatch.setattr(attention.TorchAttention, "__init__", lambda self, *a, _init=attention.TorchAttention.__init__,
                            **kw: _init(self, *a, **{**kw, "fused_prompt": False}))
    got, model = helm_generate(path, [prompt], split=1, max_new_tokens=6, page_size=8, device_kv_pages=3,
                               backend="torch", kv_slab=True, prefill_chunk=16)
    layers = model.config.num_layers
    assert model.stages[1].kv.stats().evictions > 0
    assert got[0] == want and not static_steps  # every decode step has host pages: streamed
    if flash:
        # Only the first chunk (2 pages, both in the slab) was gathered, once per layer; the later
        # chunks (16 and 13 queries) each read every cached key before them a page at a time
        assert gathered == [16] * layers
        assert segmented == [(16, 16, 16)] * layers + [(32, 32, 13)] * layers
        assert set(streamed) == {1}  # decodes only
    else:
        assert not gathered and not segmented and streamed.count(16) == 2 * layers


def test_a_prompt_chunk_whose_pages_were_parked_by_another_sequence_still_gathers(checkpoint, static_steps,
                                                                                    monkeypatch):
    """Two prompts share a device pool of 4 pages of 8 tokens: the second's chunks take pages the
    first's held, parking them. A chunk of a sequence no longer than the pool gathers its pages
    for the fused attention all the same (the parked ones come back into the gather: the memory
    the plan prices), rather than taking them a page at a time; tokens as transformers' for each prompt."""
    from executor.kv_cache import KVCache

    path = checkpoint("llama", "fp32")
    prompts = [prompt_ids(40, 256, seed=33), prompt_ids(20, 256, seed=34)]  # the first outgrows the pool
    want = [hf_greedy(path, p, 4) for p in prompts]
    parked_gathers, gathered = [], KVCache.gathered

    def spy(self, layer, seq_id, length):
        if not self.resident(seq_id):
            parked_gathers.append(length)
        return gathered(self, layer, seq_id, length)

    monkeypatch.setattr(KVCache, "gathered", spy)
    got, model = helm_generate(path, prompts, split=1, max_new_tokens=4, page_size=8, device_kv_pages=4,
                               backend="torch", kv_slab=True, prefill_chunk=8)
    assert got == want
    assert model.stages[1].kv.stats().evictions > 0
    assert parked_gathers  # gathers of sequences with a parked page
    assert max(parked_gathers) <= 4 * 8  # the first prompt's chunks past the pool's 32 tokens: a page at a time


def test_graphs_are_captured_at_load_for_every_bucket_a_step_takes(checkpoint, static_steps, monkeypatch):
    """Capture happens at load (a failed capture cannot be recovered from mid-serving), so the
    buckets captured must cover every static step the plan's budget allows: here, run eagerly on
    the CPU, every step's (rows, pages) is among the buckets capture() enumerates."""
    from dataclasses import replace

    from executor.loader import _decode_buckets

    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    placement = replace(Placement.from_split(cfg.num_units, 1, page_size_tokens=4, device_kv_pages=12),
                        kv_sequences=2, context_tokens=24)   # a budget of 12 pages, 6 per sequence at most
    model = load_model(path, placement, cfg, backend="torch", kv_slab=True)
    step = model.stages[1].fused
    assert _decode_buckets(placement, cfg) == (12, 6)
    captured = []
    monkeypatch.setattr(step, "graphs", True)
    monkeypatch.setattr(step, "_capture", lambda rows, pages: captured.append((rows, pages)))
    step.capture(*_decode_buckets(placement, cfg))
    # rows up to 16, pages up to 8, at most 16 pages gathered (the pool's 12, bucketed)
    assert sorted(captured) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (2, 8), (4, 1), (4, 2),
                                (4, 4), (8, 1), (8, 2), (16, 1)]
    monkeypatch.setattr(step, "graphs", False)
    # a budget of more pages than the default running batch: rows captured up to that batch
    wide = replace(placement, kv_sequences=100, device_kv_pages=600)
    assert _decode_buckets(wide, cfg) == (MAX_RUNNING_SEQUENCES, 6)
    prompts = [prompt_ids(n, 256, seed=n) for n in (2, 3, 5, 9)]   # short: the ledger admits several
    Engine(model).generate(prompts, SamplingParams(), StopCriteria(max_new_tokens=6, ignore_eos=True))
    taken = {(rows, cols - 3) for rows, cols in static_steps}
    assert taken and taken <= set(captured) and any(rows > 2 for rows, _ in taken)


CONFIGS = Path(__file__).resolve().parents[2] / "tools" / "model_configs"


@pytest.mark.parametrize("model,most", [("qwen3-8b", 24), ("llama-3.1-8b", 21), ("qwen2.5-7b", 22)])
def test_a_decode_block_on_the_gpu_launches_few_kernels(model, most):
    """On a fast GPU a decode step is bound by its kernels, not by HBM: even replayed as a CUDA
    graph, each costs microseconds. A block launches its 4 GEMMs, SDPA, 2 RMSNorms (3 with q/k
    norms), and these element-wise and copy ops: a cast into each of the two GEMMs that take fp32
    input, the widening of gate-up's output and of qkv's where the rotation does not widen it
    itself (before the q/k norm; inside the bias add), the q/k weights' scaling (Qwen3), the
    rotation (three ops for q and k together), v's copy beside them (not with q/k norms: the
    rotation writes q and k back over the qkv product, v already in place), one write and one
    gather of K/V, the attention output's copy into the o projection's layout, silu and its product. The
    o and down GEMMs' outputs widen inside their residual adds; the attention output and silu's
    product are written in the GEMMs' input dtype. Before, a Qwen3 block launched 44 (64 before
    PyTorch's fused RMSNorm), a Llama block 42. Everything a step's layers
    share (rotary tables, mask, page table) is made once a step."""
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / f"{model}.json").read_text()))
    per_block = decode_step_launches(cfg, 2) - decode_step_launches(cfg, 1)
    assert per_block <= most, per_block
    assert decode_step_launches(cfg, 1) - per_block <= 16
    # rows and pages change what each op reads, not how many ops run
    assert decode_step_launches(cfg, 2, rows=8, pages=4) - decode_step_launches(cfg, 1, rows=8, pages=4) == per_block


def test_compiled_blocks_give_transformers_tokens_and_compile_once_for_every_layer(checkpoint, static_steps,
                                                                                   monkeypatch):
    """HELM_COMPILE=1: each block's halves around attention compiled by torch.compile (Inductor:
    C++ here, Triton on CUDA). The tokens of transformers over padded batched steps, and one
    compile per half serves every layer: here rows 4, then 1 (PyTorch specialises it), then 2
    (rows turn dynamic) compile, and 8 reuses the dynamic one; not a compile per layer or per
    bucket. A second model of another KV pool reuses them all (a daemon loads plan after plan)."""
    from torch._dynamo.utils import counters

    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    monkeypatch.setenv("HELM_COMPILE", "1")
    torch._dynamo.reset()
    counters.clear()
    model = load_model(path, Placement.from_split(cfg.num_units, 1, page_size_tokens=4, device_kv_pages=40), cfg,
                       backend="torch", kv_slab=True)
    assert model.stages[1].fused.compiled and cfg.num_layers > 1
    stop = StopCriteria(max_new_tokens=10, ignore_eos=True)
    compiles = []
    for n in (3, 1, 2, 5):  # rows bucketed to 4, 1, 2, 8
        prompts = [prompt_ids(7 + 3 * i, 256, seed=i) for i in range(n)]
        seqs = Engine(model).generate(prompts, SamplingParams(), stop)
        assert [s.output_ids for s in seqs] == [hf_greedy(path, p, 10) for p in prompts]
        compiles.append(counters["stats"]["unique_graphs"])
    print("graphs compiled after each batch:", compiles)
    assert {rows for rows, _ in static_steps} == {1, 2, 4, 8}
    assert compiles == [2, 4, 6, 6], compiles
    other = load_model(path, Placement.from_split(cfg.num_units, 1, page_size_tokens=8, device_kv_pages=24), cfg,
                       backend="torch", kv_slab=True)
    prompts = [prompt_ids(7 + 3 * i, 256, seed=i) for i in range(3)]
    seqs = Engine(other).generate(prompts, SamplingParams(), stop)
    assert [s.output_ids for s in seqs] == [hf_greedy(path, p, 10) for p in prompts]
    assert counters["stats"]["unique_graphs"] == 6


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_half_precision_qkv_gives_the_logits_of_its_widening(checkpoint, arch, monkeypatch):
    """On CUDA the qkv projection's product stays in bf16 (TorchLinear widen=False) and attention
    widens it; on the CPU TorchLinear always widens. So the GPU's products are emulated here:
    each half-precision product without bias rounded to the weights' dtype, then widened where
    TorchLinear widens it (or its residual add does), or everywhere. Kept in bf16 or widened first, qkv gives the same
    logits: the static decode step and a fused prompt (4 device pages), streamed pages (2)."""
    from executor.torch_ops import TorchLinear

    exact = TorchLinear._project

    def gpu_products(widen_all: bool):
        def project(self, x, widen):
            y = exact(self, x, widen)
            if self.weight.dtype == torch.float32 or self.bias is not None:
                return y
            y = y.to(self.weight.dtype)  # a half-precision GEMM's output
            return y.float() if widen or widen_all else y
        return project

    path = checkpoint(arch, "bf16")
    ids = prompt_ids(40, 256, seed=6)
    for pages in (4, 2):
        logits = []
        for widen_all in (True, False):
            monkeypatch.setattr(TorchLinear, "_project", gpu_products(widen_all))
            logits.append(helm_teacher_forced_logits(path, ids, prefill=20, split=1, backend="torch",
                                                     device_kv_pages=pages, kv_slab=True))
        assert torch.equal(logits[0], logits[1]), pages


def test_no_gemm_runs_on_the_capture_stream_beside_other_engines_steps(checkpoint, monkeypatch):
    """The capture stream is one of PyTorch's pooled streams: another model's graphs may have
    been captured on it with this thread's cuBLAS handle, and replay with the workspace cuBLAS
    keeps for that (handle, stream). So the warm-up that compiles runs on this thread's stream,
    and the step on the capture stream (its workspace made before the capture) only while the
    gate holds every other engine's step back, the device synchronised. The capture on the CPU:
    streams, the graph and its context logged."""
    import contextlib

    from executor.capture_gate import GATE

    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    placement = Placement.from_split(cfg.num_units, 1, page_size_tokens=4, device_kv_pages=12)
    model = load_model(path, placement, cfg, backend="torch", kv_slab=True)
    step = model.stages[1].fused
    log, current = [], ["this thread's"]

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    @contextlib.contextmanager
    def on(stream):
        current.append(stream.name)
        try:
            yield
        finally:
            current.pop()

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode=None):
        current.append(stream.name)
        log.append(("capture", stream.name, GATE._captures))
        try:
            yield
        finally:
            current.pop()

    run = ResidentDecode.step
    monkeypatch.setattr(ResidentDecode, "step", lambda self, x, index: (
        log.append(("step", current[-1], GATE._captures)), run(self, x, index))[1])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(current[-1]))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("synchronize", GATE._captures)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(step, "_side", Stream("capture"))
    step._capture(2, 2)
    steps = [e for e in log if e[0] == "step"]
    assert steps[0] == ("step", "this thread's", 0)          # the warm-up: outside the gate
    assert all(held for _, where, held in steps if where == "capture")   # the capture stream: inside it
    on_capture_stream = log.index(("step", "capture", 1))
    assert ("synchronize", 1) in log[:on_capture_stream] and log[-2:] == [("capture", "capture", 1),
                                                                          ("step", "capture", 1)]

    # a capture whose end raises (as torch.cuda.graph's exit does, leaving its stream current):
    # the thread's own stream is current again, and the gate is let go
    @contextlib.contextmanager
    def failing(g, pool=None, stream=None, capture_error_mode=None):
        current.append(stream.name)
        yield
        raise RuntimeError("capture invalidated")

    monkeypatch.setattr(torch.cuda, "graph", failing)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.append(stream.name))
    with pytest.raises(RuntimeError, match="capture invalidated"):
        step._capture(2, 2)
    assert current[-1] == "this thread's" and GATE._captures == 0


def test_live_steps_never_share_a_capture_stream(monkeypatch):
    """PyTorch's pool hands its streams out in turn: a step's capture stream is drawn until one no
    live step captures on comes (graphs replay with the cuBLAS workspace of their capture
    stream), and a step let go gives its stream back."""
    import gc

    from executor import device_step

    class Stream:
        drawn = 0

        def __init__(self, device=None):
            self.cuda_stream = Stream.drawn % 4   # a pool of 4 streams, handed out in turn
            Stream.drawn += 1

    class Owner:
        pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(device_step, "_CAPTURE_STREAMS", type(device_step._CAPTURE_STREAMS)())
    owners = [Owner() for _ in range(3)]
    streams = [device_step._capture_stream(o, torch.device("cpu")) for o in owners]
    assert [s.cuda_stream for s in streams] == [0, 1, 2]
    Stream.drawn = 0                       # the pool comes round to the live ones' streams again
    assert device_step._capture_stream(Owner(), torch.device("cpu")).cuda_stream == 3
    del owners[1], streams[1]
    gc.collect()
    Stream.drawn = 0
    late = Owner()
    assert device_step._capture_stream(late, torch.device("cpu")).cuda_stream == 1  # let go: free again
