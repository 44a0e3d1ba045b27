"""The GPU stage on a real CUDA device (skipped on machines without one).

On CPU-only machines the GPU-side stage runs the same code on the CPU (the other tests); these
tests run it on CUDA: hand-off through a pinned buffer, VRAM pages evicted to pinned host memory
and streamed back on the copy stream.
"""
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.executor.helpers import helm_generate, helm_teacher_forced_logits, hf_greedy, hf_model, prompt_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
def test_split_on_cuda_matches_transformers_tokens_fp32(checkpoint, arch):
    """Greedy tokens on CUDA at k = 0 (all on the GPU), mid and L+1 (only the head on the GPU)
    equal transformers' (fp32), for two sequences decoding together."""
    from executor.model_config import ModelConfig

    path = checkpoint(arch, "fp32")
    units = ModelConfig.from_dir(path).num_units
    prompts = [prompt_ids(20, 256, seed=1), prompt_ids(9, 256, seed=2)]
    want = [hf_greedy(path, p, 24) for p in prompts]
    for split in (0, units // 2, units - 1):
        got, model = helm_generate(path, prompts, split=split, max_new_tokens=24)
        assert model.stages[-1].device.type == "cuda" and model.stages[-1].unit_start == split
        assert got == want, split


def test_eviction_and_streaming_on_cuda(checkpoint):
    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(30, 256, seed=3), prompt_ids(12, 256, seed=4)]
    want, _ = helm_generate(path, prompts, split=1, max_new_tokens=24)
    got, model = helm_generate(path, prompts, split=1, max_new_tokens=24, page_size=4, device_kv_pages=3)
    assert model.stages[1].kv.stats().evictions > 5
    assert got == want


@pytest.mark.parametrize("arch,compiled,paged", [("llama", "0", "0"), ("qwen3", "0", "0"), ("qwen3", "1", "0"),
                                                 ("qwen3", "0", "1"), ("llama", "0", "1")])
def test_bf16_logits_on_cuda_no_further_from_fp32_than_transformers_bf16(checkpoint, arch, compiled, paged,
                                                                         monkeypatch):
    """The CUDA stage multiplies in bf16 with fp32 accumulation, like transformers' bf16 model on
    CUDA: its logits are no further from transformers' fp32 run than that model's, and its
    argmax agrees wherever the reference's top-2 margin is wider than that error; at k = 0 (all
    on the GPU), mid and L+1 (the head alone on the GPU). Both decode paths: streaming (unbounded
    pool) and the static step over the slab (graphs), its blocks compiled by torch.compile where
    HELM_COMPILE=1 (the bf16 branches production compiles), its attention by the paged Triton
    kernels where HELM_PAGED_DECODE=1 (which must take the step: a fallback to SDPA fails)."""
    from executor.device_step import ResidentDecode
    from executor.model_config import ModelConfig

    monkeypatch.setenv("HELM_COMPILE", compiled)
    monkeypatch.setenv("HELM_PAGED_DECODE", paged)
    path = checkpoint(arch, "bf16")
    units = ModelConfig.from_dir(path).num_units
    ids = prompt_ids(52, 256, seed=5)
    with torch.no_grad():
        want = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0].float()
        half = hf_model(path, torch.bfloat16).cuda()
        own_err = (half(torch.tensor([ids]).cuda()).logits[0].float().cpu() - want).abs().max().item()
    top2 = want.topk(2, dim=-1).values

    def took_the_step(model):
        step = model.stages[-1].fused
        if model.stages[-1].unit_start < units - 1:  # a stage with blocks: its static decode step
            assert isinstance(step, ResidentDecode) and step.paged == (paged == "1") \
                and step.compiled == (compiled == "1"), (step.paged, step.compiled)
    for split in (0, units // 2, units - 1):
        for pages in (None, 8):
            got = helm_teacher_forced_logits(path, ids, prefill=20, split=split, device_kv_pages=pages,
                                             loaded=took_the_step if pages else None).cpu()
            err = (got - want).abs().max().item()
            print(f"{arch} bf16 on CUDA, split {split}, device pages {pages}: max |logit diff| {err:.3f}, "
                  f"transformers bf16 {own_err:.3f}")
            assert err <= own_err, split
            # With every logit within err, the top two can swap only where their margin is under 2·err.
            decided = (top2[:, 0] - top2[:, 1]) > 2 * err
            assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided]), split


def test_cuda_stage_is_timed_with_events(checkpoint):
    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.placement import Placement
    from executor.request_params import StopCriteria

    path = checkpoint("qwen3", "fp32")
    cfg = ModelConfig.from_dir(path)
    engine = Engine(load_model(path, Placement.from_split(cfg.num_units, 2), cfg))
    engine.generate([[11, 12, 13]], stop=StopCriteria(max_new_tokens=3))
    cpu, cuda = engine.last_step.stages
    assert (cpu.device, cuda.device) == ("cpu", "cuda") and cpu.ms > 0 and cuda.ms > 0


def test_cuda_graph_decode_matches_eager_and_transformers(checkpoint, monkeypatch):
    """Issue 11 item 6: the GPU stage's decode steps replay CUDA graphs (a bucket per rows and
    pages), with the tokens of the eager step and of transformers."""
    from executor.device_step import ResidentDecode

    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(20, 256, seed=1), prompt_ids(9, 256, seed=2), prompt_ids(3, 256, seed=3)]
    want = [hf_greedy(path, p, 24) for p in prompts]
    # 32 slots: the 3 sequences' 18 pages stay resident, and 4 rows x 8 pages fit one step's gather.
    got, model = helm_generate(path, prompts, split=1, max_new_tokens=24, page_size=8, device_kv_pages=32)
    step = model.stages[1].fused
    assert isinstance(step, ResidentDecode) and step.graphs
    assert (4, 8) in step.captured  # three sequences in a bucket of four rows, up to 8 pages
    assert got == want
    monkeypatch.setenv("HELM_CUDA_GRAPHS", "0")
    eager, model = helm_generate(path, prompts, split=1, max_new_tokens=24, page_size=8, device_kv_pages=32)
    assert not model.stages[1].fused.graphs and eager == want


def test_compiled_cuda_graph_decode_matches_transformers(checkpoint, monkeypatch):
    """HELM_COMPILE=1 on CUDA: the blocks' halves compiled by torch.compile (Triton kernels from
    Inductor) and captured in the decode step's CUDA graphs at load, every bucket; greedy tokens
    equal transformers'. The kernels a step launches are printed beside the eager ops' count."""
    from torch._dynamo.utils import counters

    from executor.device_step import ResidentDecode
    from tests.executor.helpers import decode_step_launches

    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(20, 256, seed=1), prompt_ids(9, 256, seed=2), prompt_ids(3, 256, seed=3)]
    want = [hf_greedy(path, p, 24) for p in prompts]
    monkeypatch.setenv("HELM_COMPILE", "1")
    torch._dynamo.reset()
    counters.clear()
    got, model = helm_generate(path, prompts, split=1, max_new_tokens=24, page_size=8, device_kv_pages=32)
    step = model.stages[1].fused
    assert isinstance(step, ResidentDecode) and step.graphs and step.compiled and (4, 8) in step.captured
    assert got == want
    rows, pages = 4, 8
    g = step._captured[(rows, pages)]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.graph.replay()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    eager = decode_step_launches(model.config, len(model.stages[1].blocks), rows, pages)
    print(f"\ncompiled decode step, {len(model.stages[1].blocks)} blocks: {len(kernels)} kernels replayed "
          f"(the eager ops: {eager}); {counters['stats']['unique_graphs']} graphs compiled")
    # two halves, each compiled for rows 1 (PyTorch specialises it) and once for every other row
    # count (captured in the order 1, 2, 4, ...: rows turn dynamic at 2)
    assert counters["stats"]["unique_graphs"] <= 4
    # the point: fused element-wise ops (and the profiler saw the replay's kernels at all)
    assert 0 < len(kernels) < eager


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_paged_decode_kernels_in_cuda_graphs_match_transformers(checkpoint, arch, monkeypatch):
    """HELM_PAGED_DECODE=1 on CUDA: decode attention by executor/paged_decode.py's Triton kernels,
    straight over the slab's pages and captured in the decode graphs (compiled at the capture's
    warm-up); three sequences in a bucket of four rows; fp32 (IEEE products); greedy tokens equal
    transformers'. The kernels a replay launches are printed beside the SDPA step's count."""
    from executor.device_step import ResidentDecode

    path = checkpoint(arch, "fp32")
    prompts = [prompt_ids(20, 256, seed=1), prompt_ids(9, 256, seed=2), prompt_ids(3, 256, seed=3)]
    want = [hf_greedy(path, p, 24) for p in prompts]
    monkeypatch.setenv("HELM_PAGED_DECODE", "1")
    got, model = helm_generate(path, prompts, split=1, max_new_tokens=24, page_size=16, device_kv_pages=32)
    step = model.stages[1].fused
    assert isinstance(step, ResidentDecode) and step.paged and step.graphs and (4, 4) in step.captured
    assert got == want
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step._captured[(4, 4)].graph.replay()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"\npaged decode step, {len(model.stages[1].blocks)} blocks: {len(kernels)} kernels; "
          f"{sorted(set(n[:40] for n in kernels))}")
    assert any("_attend_split" in n for n in kernels) and any("_combine" in n for n in kernels)
    # one long sequence: 8 pages of 16 in its bucket, its 128 keys split over two programs a KV head
    long = [prompt_ids(70, 256, seed=4)]
    got, model = helm_generate(path, long, split=1, max_new_tokens=14, page_size=16, device_kv_pages=32)
    assert model.stages[1].fused.paged and (1, 8) in model.stages[1].fused.captured
    assert got == [hf_greedy(path, long[0], 14)]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [(torch.bfloat16, 32, 8, 128), (torch.float16, 16, 16, 64),
                                                          (torch.bfloat16, 28, 4, 128)])
def test_flash_attention_a_page_at_a_time_gives_attention_on_cuda(dtype, heads, kv_heads, head_dim):
    """segmented_prompt_attention's flash operator on this GPU and torch: its log-sum-exps merge
    pages into attention's values (the load-time check every GPU stage makes; None: it serves)."""
    from executor.attention import segmented_attention_error

    assert segmented_attention_error(torch.device("cuda"), dtype, heads, kv_heads, head_dim) is None


def test_bf16_prompts_longer_than_the_device_pool_take_flash_a_page_at_a_time_on_cuda(checkpoint, monkeypatch):
    """A GPU stage with 2 device pages of 16 tokens, a 70-token prompt in chunks of 24: the chunks
    past the pool take flash attention a page at a time over their cached keys (parked pages
    prefetched, outputs merged by log-sum-exp; the first chunk gathers); logits at every position
    no further from transformers' fp32 than transformers' own bf16, argmax where decided."""
    from executor import attention

    calls, segmented = [], attention.segmented_prompt_attention

    def spy(q, cached, *rest):
        cached = list(cached)
        calls.append((q.shape[0], sum(k.shape[1] for k, _, _ in cached)))
        return segmented(q, cached, *rest)
    monkeypatch.setattr(attention, "segmented_prompt_attention", spy)
    path = checkpoint("qwen3", "bf16")
    ids = prompt_ids(80, 256, seed=7)
    with torch.no_grad():
        want = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0].float()
        half = hf_model(path, torch.bfloat16).cuda()
        own_err = (half(torch.tensor([ids]).cuda()).logits[0].float().cpu() - want).abs().max().item()
    layers = []
    got = helm_teacher_forced_logits(path, ids, prefill=70, split=1, device_kv_pages=2, prefill_chunk=24,
                                     loaded=lambda model: layers.append(len(model.stages[1].blocks))).cpu()
    # the chunks at 24 and 48 over their 24 and 48 cached keys (the first gathers: 24 <= 32 tokens)
    assert calls == [(24, 24)] * layers[0] + [(22, 48)] * layers[0], calls
    err = (got - want).abs().max().item()
    print(f"\nbf16, a page at a time: max |logit diff| {err:.3f}, transformers bf16 {own_err:.3f}")
    assert err <= own_err, (err, own_err)
    top2 = want.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])


@pytest.mark.parametrize("slow_writes", [False, True])
def test_prefetch_reads_what_the_compute_stream_wrote_in_a_loop(checkpoint, slow_writes, monkeypatch):
    """Issue 11 item 1: a page that starts on the host (the device pool is full of partial pages)
    is filled by a prompt chunk on the compute stream and prefetched on the copy stream in the
    same layer; without the copy stream waiting, attention reads stale pinned memory. slow_writes:
    every write into a host page starts after a spin on the compute stream, so a prefetch that
    does not wait for it reads the page before the write lands every time, not by chance."""
    from executor.kv_cache import KVCache

    written, write = [], KVCache._write_host_page

    def counted(dst, slot, k, v):
        written.append(k.shape[0])
        if slow_writes:
            torch.cuda._sleep(500_000)  # cycles: longer than a page's copy
        return write(dst, slot, k, v)
    monkeypatch.setattr(KVCache, "_write_host_page", staticmethod(counted))
    path = checkpoint("qwen3", "fp32")
    prompts = [prompt_ids(n, 256, seed=n) for n in (40, 11, 27)]
    want, _ = helm_generate(path, prompts, max_new_tokens=12)
    for i in range(5 if slow_writes else 20):
        written.clear()
        got, model = helm_generate(path, prompts, split=1, max_new_tokens=12, page_size=8, device_kv_pages=2)
        assert model.stages[1].kv.stats().evictions > 0 and written  # host pages were written
        assert got == want, f"iteration {i}"


def test_a_gather_brings_pages_another_sequence_parked_back_exactly_in_a_loop():
    """KVCache.gathered on CUDA for a sequence whose pages another sequence parked (a pool of 3
    pages of 4 tokens, 10 + 9 tokens written): what the GPU stage's prompt chunks hand flash
    attention (bf16). The parked pages come back through the copy stream's prefetch into the one
    buffer, bit for bit what was written, in every round."""
    from executor.kv_cache import KVCache

    device = torch.device("cuda")
    for i in range(20):
        kv = KVCache(2, 2, 8, torch.bfloat16, device, page_size=4, device_pages=3, host_pages=8, slab=True)
        written, g = {}, torch.Generator().manual_seed(i)
        for seq, n in (("a", 10), ("b", 9)):
            kv.reserve(seq, n)
            for layer in range(2):
                k, v = (torch.randn(n, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2))
                kv.write(layer, seq, 0, k.to(device), v.to(device))
                written[seq, layer] = k, v
        assert not kv.resident("a") and kv.gathers("a", 10) and kv.stats().evictions > 0
        for layer in range(2):
            k, v = kv.gathered(layer, "a", 10)
            want_k, want_v = written["a", layer]
            assert torch.equal(k.cpu(), want_k.transpose(0, 1)) and torch.equal(v.cpu(), want_v.transpose(0, 1)), i


def test_a_3000_token_prompt_offloaded_from_a_2_page_pool_is_exact(checkpoint):
    path = checkpoint("qwen3", "fp32", max_position_embeddings=4096)
    prompt = prompt_ids(3000, 1024, seed=9)
    want, _ = helm_generate(path, [prompt], split=1, max_new_tokens=16)
    got, model = helm_generate(path, [prompt], split=1, max_new_tokens=16, device_kv_pages=2)
    assert model.stages[1].kv.stats().evictions > 0
    assert got == want


def test_host_kv_pages_are_page_locked_at_their_exact_size():
    from executor.kv_cache import PagePool

    pool = PagePool(torch.device("cpu"), (3, 1000, 7), torch.bfloat16, capacity_pages=2, pin_memory=True)
    page = pool.allocate()
    assert page.is_pinned()
    # Registered memory of exactly its size (ours), not a power-of-two block of PyTorch's pinned
    # allocator, which cudaHostUnregister would refuse.
    cudart, ptr, size = torch.cuda.cudart(), page.data_ptr(), 3 * 1000 * 7 * 2
    assert int(cudart.cudaHostUnregister(ptr)) == 0
    assert int(cudart.cudaHostRegister(ptr, size, 0)) == 0
    src = torch.randn(3, 1000, 7, device="cuda").to(torch.bfloat16)
    page.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(page, src.cpu())


def test_a_kv_write_into_a_host_page_lands(checkpoint):
    """Issue 11 item 3: K/V written straight into a host-resident page (a new page whose device
    pool is full of partial pages) arrive, through the per-head asynchronous copies."""
    from executor.kv_cache import KVCache

    kv = KVCache(2, 2, 8, torch.bfloat16, torch.device("cuda"), page_size=4, device_pages=1, host_pages=4)
    kv.reserve("a", 1)
    kv.reserve("b", 3)  # the device page is a's and partial: b's page starts on the host
    assert [page.on_device for page in kv.pages_of("b")] == [False]
    # k in fp32, v in bf16: as a GPU stage's attention hands them on (its qkv stays in bf16)
    k, v = torch.randn(3, 2, 8, device="cuda"), torch.randn(3, 2, 8, device="cuda").to(torch.bfloat16)
    kv.write(1, "b", 0, k, v)
    got_k, got_v, start = next(kv.chunks(1, "b", 3))
    torch.cuda.synchronize()
    assert start == 0
    assert torch.equal(got_k.cpu(), k.transpose(0, 1).to(torch.bfloat16).cpu())
    assert torch.equal(got_v.cpu(), v.transpose(0, 1).to(torch.bfloat16).cpu())


def test_a_vram_cap_holds_under_16_concurrent_requests_at_the_plans_context(checkpoint, monkeypatch):
    """Issue 11 item 7: with VRAM capped 64 MiB above what the load took (weights, the KV slab,
    the decode graphs captured at load), 16 requests at the plan's context all finish: admission
    holds them to the plan's KV budget (4 sequences of 8 pages at a time), decode replays the
    captured graphs, and nothing allocates beyond the cap."""
    from dataclasses import replace

    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.placement import Placement
    from executor.request_params import StopCriteria

    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: (replays.append(1), replay(self))[1])
    path = checkpoint("qwen3", "bf16", max_position_embeddings=4096)
    cfg = ModelConfig.from_dir(path)
    placement = replace(Placement.from_split(cfg.num_units, 1, page_size_tokens=64, device_kv_pages=32),
                        kv_sequences=4, context_tokens=512)
    torch.cuda.empty_cache()
    engine = Engine(load_model(path, placement, cfg), eos_token_ids=())
    assert (4, 8) in engine.model.stages[1].fused.captured
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    a @ a  # the default stream's cuBLAS workspace, which prompt chunks need, before the cap (graphs ran on another)
    cap = torch.cuda.memory_reserved() + (64 << 20)
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        stop = StopCriteria(max_new_tokens=200, ignore_eos=True)
        seqs = [engine.add_request(prompt_ids(300, 1024, seed=i), stop=stop) for i in range(16)]
        most = 0
        while engine.has_work():
            engine.step()
            most = max(most, len(engine.running))
        # Over the cap the allocator raises OutOfMemoryError, which fails a request: all finish.
        assert all(s.finish_reason == "length" and len(s.output_ids) == 200 for s in seqs), \
            [(s.finish_reason, s.error) for s in seqs]
        assert most == 4 and len(replays) > 100
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_daemon_under_its_gpu_memory_cap_serves_16_concurrent_streams_at_the_plans_context(
        checkpoint, tmp_path):
    """Issue 11 item 7, through the daemon: `serve --gpu-memory` at the plan's GPU bytes and a
    margin caps PyTorch's allocator in the daemon's process (the placeholder profile prices no
    cuBLAS workspace: on Hopper 32 MiB for each stream that multiplies, the loader's, the capture
    stream's and the engine's, and the allocator's rounding); 16 concurrent Generate streams, each at the plan's context (prompt + new tokens), all
    finish or are refused before their first token (the queue), none fails mid-stream (an OOM
    would), the daemon logs no OutOfMemoryError; a request beyond the context is refused up front."""
    import threading

    import grpc

    from executor.pb import executor_pb2 as pb
    from executor.plan_io import plan_gpu_bytes
    from executor.server.client import ExecutorClient
    from planner.plan import load_plan, save_plan
    from planner.planning import plan_for_split, workload_for
    from tests.executor.daemon.helpers import collect, serving_daemon

    path = checkpoint("qwen3", "bf16", max_position_embeddings=4096)
    plan_file = tmp_path / "plan.yaml"
    save_plan(plan_for_split(path, 1, page_size_tokens=64,
                             workload=workload_for(300, 212, batch_size=4, context_tokens=512)), plan_file)
    cap = plan_gpu_bytes(load_plan(plan_file)) + (512 << 20)
    args = ["--plan", str(plan_file), "--gpu-memory", str(cap), "--max-batch", "4", "--max-queue", "16"]
    with serving_daemon(args, tmp_path / "daemon.log") as daemon, ExecutorClient(daemon.addr) as client:
        def request(i, prompt_tokens=300, new_tokens=212):
            return pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(ids=prompt_ids(prompt_tokens, 1024, seed=i)),
                                      stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
        results, refused, failed = {}, [], []

        def run(i):
            tokens = 0
            try:
                for msg in client.stub.Generate(request(i), timeout=300):
                    if msg.HasField("token"):
                        tokens += 1
                    else:
                        results[i] = (tokens, msg.result.finish_reason)
            except grpc.RpcError as e:
                (refused if tokens == 0 and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else failed).append(
                    (i, tokens, e.code(), e.details()))
        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(330)
        assert not failed, failed
        assert len(results) + len(refused) == 16 and len(results) >= 4
        assert all(r == (212, pb.FINISH_REASON_LENGTH) for r in results.values()), results
        with pytest.raises(grpc.RpcError) as err:
            collect(client.stub.Generate(request(99, prompt_tokens=400, new_tokens=200), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.value.details()
        print(f"\n16 streams under a {cap / 2**20:.0f} MiB cap: {len(results)} finished, {len(refused)} refused "
              "up front (queue full)")
    log = (tmp_path / "daemon.log").read_text()
    assert "OutOfMemoryError" not in log and "GPU memory capped" in log


def test_the_plans_gpu_bytes_bound_what_the_gpu_stage_allocates(checkpoint):
    """planner/working_set.py against CUDA's allocator: a plan for 2 sequences of 1024 tokens
    (prompts of 957: a second chunk of 445 queries attends over 957 keys through flash attention,
    lower-right causal; decode steps take the graphs' masked step over 1024 keys), priced as the
    profile would price this GPU, served at its batch and context, allocates at its peak no more
    than the plan's GPU bytes (weights, KV pages, working set) plus the capture stream's cuBLAS
    workspace. Prints both, for the notes."""
    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.plan_io import placement_for
    from executor.request_params import StopCriteria
    from planner.planning import plan_for_split, workload_for
    from planner.profile import cuda_stream_workspace_bytes, flash_attention_runs, placeholder_machine

    path = checkpoint("qwen3", "bf16", max_position_embeddings=4096)
    cfg = ModelConfig.from_dir(path)
    # priced as the profile would price this GPU: its prompt chunks through flash attention where it runs
    placeholder = placeholder_machine()
    flash = flash_attention_runs("cuda", torch.bfloat16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    machine = replace(placeholder, gpu=replace(placeholder.gpu, flash_attention=flash))
    plan = plan_for_split(path, 1, machine, page_size_tokens=64, workload=workload_for(957, 67, batch_size=2))
    priced = plan.search.candidates[1].gpu_bytes
    # the capture stream's cuBLAS workspace, measured as the profile measures it (the default
    # stream's made first, as the profile's probes had). cuBLAS keeps one per stream of PyTorch's
    # pool for good: cleared first, so earlier tests' streams neither hide it here nor in the load
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    a @ a
    workspace = cuda_stream_workspace_bytes(torch.bfloat16)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = Engine(load_model(path, placement_for(plan, cfg), cfg), eos_token_ids=())
    stop = StopCriteria(max_new_tokens=64, ignore_eos=True)
    seqs = [engine.add_request(prompt_ids(957, cfg.vocab_size, seed=i), stop=stop) for i in range(2)]
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason == "length" for s in seqs)
    peak = torch.cuda.max_memory_allocated() - base
    print(f"\nGPU stage peak {peak / 2**20:.2f} MiB; plan {priced / 2**20:.2f} MiB (working set "
          f"{plan.partition.stages[1].working_bytes / 2**20:.2f} MiB, flash attention {flash}) + cuBLAS workspace "
          f"{workspace / 2**20:.2f} MiB")
    assert peak <= priced + workspace


def test_the_profiles_decode_block_probe_runs_the_graphed_step_and_gives_its_memory_back():
    """probe_cuda times a Qwen3-8B block through the GPU stage's decode step replayed as CUDA
    graphs, beside its roofline; nothing it allocated stays allocated. Prints the figures, for
    the notes (δ = the block's time beyond its roofline)."""
    from planner.profile import probe_cuda, profiled_gpu_delta_ms

    # from a known state: the default stream's cuBLAS workspace only (the profile's first GEMM makes it)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    said = []
    gpu, _ = probe_cuda(True, said.append)
    torch.cuda.synchronize()
    print("\n" + "\n".join(m for m in said if m.startswith(("decode", "prefill"))))
    assert gpu.decode_block_ms is not None, said
    assert gpu.decode_block_ms > 0 and gpu.decode_block_roofline_ms > 0 and "CUDA graph" in gpu.decode_block
    assert profiled_gpu_delta_ms(gpu) >= 0
    # the probe stages' capture streams left no cuBLAS workspace behind: what remains is the
    # workspace of the stream the profile makes to measure one (kept by design, the plan prices it)
    assert torch.cuda.memory_allocated() - before <= (gpu.stream_workspace_bytes or 0) + (1 << 20)


def test_sampling_rows_on_cuda_draws_what_it_draws_on_the_cpu():
    """sample_rows on a GPU stage's logits (every row's filters there, only candidates copied)
    gives the tokens it gives on the same logits on the CPU, with the same seeds: the greedy and
    top-k rows exactly (their arithmetic is the host's), as a large nucleus (found on the host);
    the others as long as the GPU's float64 exp and cumsum round alike or the draws miss the last
    bit where they do not. Candidates come in an order of the logits' own, not of a topk's."""
    from executor.request_params import SamplingParams
    from executor.sampling import make_generator, sample_rows

    g = torch.Generator().manual_seed(0)
    logits = ((torch.randn(6, 151936, generator=g) * 4).round() / 2)   # ties inside the top k
    logits[5, torch.arange(40) * 97] = 30.0       # a nucleus the probe holds, ending among 40 tied tokens
    params = [SamplingParams(), SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=1),
              SamplingParams(temperature=0.9, top_k=300, seed=2), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(temperature=1.2, seed=4), SamplingParams(temperature=1.0, top_p=0.3, seed=5)]
    on_cpu, on_gpu = [make_generator(p) for p in params], [make_generator(p) for p in params]
    for _ in range(10):
        assert sample_rows(logits.cuda(), params, on_gpu) == sample_rows(logits, params, on_cpu)


def test_prompt_attention_on_cuda_is_flash_with_no_mask():
    """A late prompt chunk's attention on CUDA (executor/attention.py, lower_right_causal_attention)
    runs flash attention: its queries see the cached keys and their own causally (against fp32 math
    with K/V repeated per head and the mask made), and it allocates nothing of chunk × context
    size (a boolean mask here would be 4 MiB): planner/working_set.py prices its gathered K/V and
    log-sum-exp only. The GPU stage takes this path for a bf16 cache; an fp32 one streams."""
    from executor.attention import TorchAttention, lower_right_causal_attention
    from planner.profile import flash_attention_runs

    assert flash_attention_runs("cuda", torch.bfloat16, 32, 8, 128)
    assert not flash_attention_runs("cuda", torch.float32, 32, 8, 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, L, scale = 512, 8192, 128 ** -0.5
    q = torch.randn(32, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(8, L, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = lower_right_causal_attention(q, k, v, scale)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    print(f"\nflash prompt attention, chunk {n} over {L} keys: {extra} bytes beside its output")
    assert extra <= 4 * 32 * n + (1 << 20), extra   # the LSE and a little bookkeeping, never n × L
    # a short last chunk with few heads cannot fill the GPU: flash attention may split its keys
    # into fp32 accumulators (not priced: measured here for the notes, bounded by the SMs)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    short = torch.randn(16, 64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    few = lower_right_causal_attention(short, k[:4], v[:4], scale)
    torch.cuda.synchronize()
    split = torch.cuda.max_memory_allocated() - base - few.numel() * few.element_size()
    print(f"flash prompt attention, chunk 64 of 16 heads over {L} keys on {sms} SMs: {split} bytes beside its output")
    assert split <= 4 * 16 * 64 + 4 * 2 * sms * 64 * 128 * 4 + (1 << 20), split
    visible = torch.arange(L, device="cuda")[None, :] <= torch.arange(L - n, L, device="cuda")[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float()[None], k.float().repeat_interleave(4, 0)[None], v.float().repeat_interleave(4, 0)[None],
        attn_mask=visible, scale=scale)[0]
    assert (out.float() - want).abs().max().item() < 2e-2

    class Config:
        num_heads, num_kv_heads, head_dim = 32, 8, 128

    class Cache:
        device = torch.device("cuda")

    for dtype, fused in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        Cache.dtype = dtype
        assert TorchAttention(Config, Cache, None, fused_prompt=True).fused_prompt is fused


def test_rms_norm_on_cuda_is_the_fused_kernel_and_matches_the_reference():
    """torch_ops.rms_norm on CUDA is PyTorch's fused kernel (one launch, not six), and gives what the
    reference steps give on the CPU, for rows of a block's hidden size and of a head (q/k norm on
    a strided view of the fused QKV output)."""
    from executor import torch_ops

    g = torch.Generator().manual_seed(3)
    for shape, width in (((5, 4096), 4096), ((5, 40, 128), 128)):
        x, w = torch.randn(*shape, generator=g), torch.randn(width, generator=g)
        want = torch_ops.rms_norm(x, w, 1e-6)
        got = torch_ops.rms_norm(x.cuda(), w.cuda(), 1e-6).cpu()
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    qkv = torch.randn(5, 48 * 128, generator=g).cuda()
    q = qkv[:, :40 * 128].view(5, 40, 128)              # a view with the row stride of qkv
    w = torch.randn(128, generator=g).cuda()
    assert (torch_ops.rms_norm(q, w, 1e-6) - torch_ops.rms_norm(q.cpu(), w.cpu(), 1e-6).cuda()).abs().max() < 1e-4
    wide = w.repeat(32)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch_ops.rms_norm(qkv[:, :4096], wide, 1e-6)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"\nrms_norm on CUDA: {len(kernels)} kernel(s): {sorted({e.name[:60] for e in kernels})}")
    assert 1 <= len(kernels) <= 2, [e.name for e in kernels]   # the norm (and at most a copy of a strided input)


def test_the_decode_steps_kernels_on_cuda_are_those_counted_on_the_meta_device(checkpoint):
    """tests/executor/test_device_step.py holds the GPU stage's decode step to few launches by
    counting its ops on the meta device; here the kernels the same step launches on CUDA
    (eagerly: a graph replays the same ones), against that count: none fewer, and more only by
    what a GEMM may launch beside its own kernel (cuBLAS splitting a reduction), one per GEMM."""
    from torch.profiler import ProfilerActivity, profile

    from tests.executor.helpers import decode_step_launches

    path = checkpoint("qwen3", "bf16")
    _, model = helm_generate(path, [prompt_ids(5, 256, seed=1)], split=1, max_new_tokens=2, page_size=16,
                             device_kv_pages=16)
    stage, cfg = model.stages[1], model.config
    step = stage.fused
    rows, pages = 2, 4
    x = torch.randn(rows, cfg.hidden_size, device="cuda")
    index = torch.full((rows, 3 + pages), step.pool.scratch_slot, dtype=torch.int64, device="cuda")
    index[:, 0] = index[:, 2] = 0  # position 0, row 0 of the scratch slot
    step.step(x.clone(), index)  # warm-up: cuBLAS handles, SDPA's kernel choice
    x = x.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.step(x, index)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    counted = decode_step_launches(cfg, len(stage.blocks), rows, pages)
    print(f"\ndecode step, {len(stage.blocks)} blocks: {len(kernels)} CUDA kernels, {counted} counted on meta; "
          f"{sorted(set(n[:50] for n in kernels))}")
    assert counted <= len(kernels) <= counted + 4 * len(stage.blocks), sorted(kernels)


def test_pinned_staging_never_overwrites_a_copy_in_flight():
    """executor/staging.py: host tensors copied back to back through one reused page-locked buffer,
    the GPU kept busy so the copies queue behind its work, all arrive as they were (the buffer is
    refilled only once its last copy is done), into new tensors and into a given one."""
    from executor.staging import PinnedStaging

    staging = PinnedStaging(torch.device("cuda"))
    big = torch.randn(4096, 4096, device="cuda")
    sent, got = [], []
    for i in range(20):
        big @ big  # a few ms of GPU work ahead of each copy
        x = torch.full((3000,), float(i))
        sent.append(x)
        got.append(staging.to_device(x))
    into = torch.empty(3000, device="cuda")
    staging.to_device(torch.full((3000,), -1.0), out=into)
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), s) for g, s in zip(got, sent)) and bool((into == -1).all())


# Run in a child process: a device-side assert poisons the CUDA context of the process it hits.
LOSES_THE_GPU = '''
import sys
import torch
from executor.engine import Engine, lost_device
from executor.errors import DeviceLostError
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.request_params import StopCriteria

gpu = torch.device("cuda")
try:
    torch.empty(1 << 50, dtype=torch.uint8, device=gpu)  # a PiB: out of memory, which is not sticky
except torch.OutOfMemoryError:
    pass
print("after an OOM:", lost_device([gpu]))

cfg = ModelConfig.from_dir(sys.argv[1])
engine = Engine(load_model(sys.argv[1], Placement.from_split(cfg.num_units, 1), cfg))
stage = engine.model.stages[1]
real_forward = stage.forward

def forward(x, batch):
    if any(s.start + s.count > 5 for s in batch.slices):  # a device-side assert (x arrives on the CPU)
        torch.zeros(4, device=gpu).index_select(0, torch.tensor([1 << 20], device=gpu))
    return real_forward(x, batch)

stage.forward = forward
engine.add_request([11, 12, 13], stop=StopCriteria(max_new_tokens=8, ignore_eos=True))
try:
    while engine.has_work():
        engine.step()
    print("no error")
except DeviceLostError as e:
    print("lost:", e)
'''


def test_a_sticky_cuda_error_is_a_lost_device_and_an_oom_is_not(checkpoint, tmp_path):
    """A real device-side assert in a CUDA stage: the engine's device check after the failed step
    finds the context unusable and raises DeviceLostError (the daemon then drains and exits for a
    restart: tests/executor/daemon/test_lifecycle.py), where an out-of-memory left it working."""
    import subprocess
    import sys

    path = checkpoint("qwen3", "fp32")
    script = tmp_path / "loses_the_gpu.py"
    script.write_text(LOSES_THE_GPU)
    repo = str(Path(__file__).resolve().parents[2])  # the child imports executor from this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=300,
                         env=env)
    print(out.stdout, out.stderr[-2000:])
    assert "after an OOM: None" in out.stdout
    assert "lost: the GPU can run nothing more in this process (cuda:" in out.stdout


def test_prefix_reuse_on_cuda_with_offloaded_pages_is_exact(checkpoint):
    """Prompt prefix reuse with the GPU stage's KV offloaded: turn 1's pages are kept, a long
    request pushes them to pinned host memory, and turn 2, which parts from turn 1 inside a kept
    page, shares the full pages (streamed back) and copies the matching tokens out of a host page
    (the copy waits for the eviction that put it there). Tokens equal an engine's that keeps
    nothing, and transformers' (fp32)."""
    from executor.request_params import StopCriteria
    from tests.executor.helpers import budget_engine

    path = checkpoint("qwen3", "fp32")
    stop = StopCriteria(max_new_tokens=6, ignore_eos=True)
    turn1 = prompt_ids(18, 256, seed=110)
    turn2 = turn1[:14] + prompt_ids(9, 256, seed=111)  # parts inside turn 1's fourth page of 4
    engines = [budget_engine(path, sequences=2, context=48, split=1, device_kv_pages=3, prefix_cache=keep)
               for keep in (True, False)]
    outputs = []
    for engine in engines:
        engine.generate([turn1], stop=stop)
        engine.generate([prompt_ids(40, 256, seed=112)], stop=stop)  # fills the device pool
        outputs.append(engine.generate([turn2], stop=stop)[0])
    warm, cold = outputs
    assert engines[0].model.stages[1].device.type == "cuda" and engines[0].model.stages[1].kv.stats().evictions > 0
    assert warm.reused_tokens == 14 and cold.reused_tokens == 0
    assert warm.output_ids == cold.output_ids == hf_greedy(path, turn2, 6)


def test_a_plan_loading_beside_a_serving_engine_captures_its_graphs_while_that_engine_steps(checkpoint):
    """executor/capture_gate.py: one thread steps an engine with a GPU stage through requests that
    end every few steps (each end frees pages: a device synchronise), while this one loads a second
    model whose decode graphs are captured. CUDA forbids that synchronise during a capture: the
    gate holds steps back while each graph is captured, so the load succeeds and every request
    ends with its tokens."""
    import threading

    from executor.engine import Engine
    from executor.loader import load_model
    from executor.model_config import ModelConfig
    from executor.placement import Placement
    from executor.request_params import StopCriteria

    path = checkpoint("qwen3", "bf16")
    cfg = ModelConfig.from_dir(path)

    def placement():
        return replace(Placement.from_split(cfg.num_units, 1, page_size_tokens=16, device_kv_pages=16),
                       kv_sequences=4, context_tokens=64)

    serving = Engine(load_model(path, placement(), cfg), eos_token_ids=(), prefix_cache=False)  # each end frees
    done, seqs, errors = threading.Event(), [], []

    def serve():
        try:
            i = 0
            while not done.is_set():
                seqs.append(serving.add_request(prompt_ids(5, 256, seed=i), stop=StopCriteria(max_new_tokens=2,
                                                                                               ignore_eos=True)))
                while serving.has_work():
                    serving.step()
                i += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=serve, daemon=True)  # one wedged must not hold pytest's exit
    t.start()
    try:
        for _ in range(3):
            loaded = load_model(path, placement(), cfg)
            assert loaded.stages[1].fused.captured
    finally:
        done.set()
        t.join(60)
    assert not t.is_alive(), "the serving engine did not finish its request within 60 s of the loads"
    assert not errors and len(seqs) > 3
    assert all(s.finish_reason == "length" and len(s.output_ids) == 2 for s in seqs), \
        [(s.finish_reason, s.error) for s in seqs if s.finish_reason != "length"]


@pytest.mark.parametrize("arch,slow", [("qwen3", None), ("llama", None), ("qwen2", None),
                                       ("qwen3", "products"), ("qwen3", "copies")])
def test_streamed_prompt_steps_on_cuda_match_transformers_in_a_loop(checkpoint, arch, slow, monkeypatch):
    """The CPU stage's prompt steps on the GPU, their weights streamed from page-locked host memory
    in pieces of a few rows through the ring of 3 device slots (every projection crosses in many
    pieces, so a slot is refilled while products before it may still read it, unless the events
    order them); the chunks' K/V written back into the stage's page-locked pages, which later
    chunks copy in and the CPU kernels' decode reads. slow: every product, or every copy, starts
    after a spin on its stream, so a missing wait (a copy into a slot a product still reads, a
    product of a slot whose copy has not landed) reads the wrong weights every time, not by chance."""
    import executor.streamed_prefill as sp
    from executor.request_params import SamplingParams, StopCriteria
    from executor.streamed_prefill import StreamedPrefill
    from tests.executor.test_streamed_prefill import count_streamed_steps, streamed_engine

    spin = 500_000  # cycles: a fraction of a millisecond, longer than a piece's copy or product
    if slow == "products":
        linear = torch.nn.functional.linear

        class SlowProducts:
            @staticmethod
            def linear(*args, **kwargs):
                torch.cuda._sleep(spin)
                return linear(*args, **kwargs)
        monkeypatch.setattr(sp, "F", SlowProducts)
    elif slow == "copies":
        upload = StreamedPrefill._upload

        def slow_upload(self, piece):
            with torch.cuda.stream(self._copy_stream):
                torch.cuda._sleep(spin)
            return upload(self, piece)
        monkeypatch.setattr(StreamedPrefill, "_upload", slow_upload)
    path = checkpoint(arch, "fp32")
    prompt = prompt_ids(70, 256, seed=31)
    want = hf_greedy(path, prompt, 8)
    steps = count_streamed_steps(monkeypatch)
    for _ in range(3 if slow is None else 1):
        # steps of 48 streamed (the GPU stage takes them in sub-steps of 24), their fp32 values made
        # 16 rows at a time: query blocks over the cached pages and their own keys
        engine, streamed = streamed_engine(path, split=3, min_rows=2, piece_bytes=4096, prefill_chunk=24,
                                           stream_chunk=48)
        streamed.row_block = 16
        assert streamed.device.type == "cuda" and streamed.blocks[0].gate_up.weight.is_pinned()
        assert engine.model.stages[1].device.type == "cuda"
        seq = engine.generate([prompt], SamplingParams(), StopCriteria(max_new_tokens=8, ignore_eos=True))[0]
        assert engine.model.stages[0].kv.device_pool.pin_memory
        assert seq.output_ids == want
    assert steps[:2] == [48, 22]  # the prompt's chunks streamed
