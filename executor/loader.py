"""Build the stages of a placement from a checkpoint, streaming each tensor to its owner.

Weights are read one tensor at a time (memory-mapped safetensors) and moved straight to the
device of the stage that owns the unit, so peak host memory while loading is the CPU stages'
weights plus one tensor.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.backends import make_backend, resolve_backend
from executor.device_step import ResidentDecode
from executor.errors import WeightsError
from executor.host_memory import page_aligned
from executor.kv_cache import KVCache
from executor.model_config import ModelConfig
from executor.placement import Placement, StageSpec, resolve_device
from executor.probe import DTYPES, measured_choice
from executor.stage import BlockWeights, HeadWeights, Stage
from executor.streamed_prefill import StreamedPrefill
from planner.profile import flash_attention_runs
from planner.units import fmt_bytes
from executor.weights import CheckpointReader
from planner.step_shape import MAX_RUNNING_SEQUENCES

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    stages: list[Stage]
    placement: Placement
    model_dir: Path

    @property
    def stream_prefill(self) -> int | bool:
        """What its CPU stages run of the plan's streaming policy: prompt steps of this many tokens
        streamed to the GPU (executor/streamed_prefill.py), or False: none (what a Recorder
        measures it against; where the load could not stream, not the plan's)."""
        return next((s.streamed.min_rows for s in self.stages if s.streamed is not None), False)

    def free_sequence(self, seq_id) -> None:
        for stage in self.stages:
            if stage.kv is not None:
                stage.kv.free(seq_id)


def kv_pools(placement: Placement, planned_device: str) -> tuple[int | None, int | None]:
    """(device pages, host pages) of a stage's KV pools (None: unbounded; host 0: no host pool).
    With a plan, the pools hold its budget: the GPU stage's device_kv_pages in VRAM and the rest
    in pinned host memory (KV offload), or all of it where it is made; the engine admits no more
    (Engine's KV ledger), so the pools bound memory a second time, never the first."""
    budget = placement.kv_budget_pages
    if planned_device == "cuda" and placement.device_kv_pages is not None:
        return placement.device_kv_pages, None if budget is None else max(0, budget - placement.device_kv_pages)
    return budget, 0


def load_model(model_dir: str | Path, placement: Placement, config: ModelConfig | None = None,
               backend: str = "auto", kv_slab: bool | None = None,
               streamed_prefill: bool | None = None) -> LoadedModel:
    """Stages of `placement` with weights from `model_dir`. backend: CPU-stage kernels (auto|helm|torch).
    kv_slab: whether a GPU stage's bounded device KV pool is one slab, which its static decode
    step (executor/device_step.py) needs; None: where the stage runs on CUDA. True also gives it
    to a GPU stage that runs on the CPU (no CUDA here), which is how the CPU tests run that step.
    streamed_prefill: whether a CPU stage whose plan streams its prompt steps to the GPU does so
    (executor/streamed_prefill.py); None: where there is CUDA and flash attention runs the model's
    attention there (without CUDA the stage's own kernels beat PyTorch on the same CPU). True
    runs that code in any case, with CPU tensors for the device where there is no CUDA: how the
    tests run it."""
    backend = resolve_backend(backend)
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    if placement.num_units != config.num_units:
        raise ValueError(f"placement has {placement.num_units} units, the model has {config.num_units}")
    if placement.cpu_threads is not None:
        # One OpenMP pool: PyTorch's ops (prefill GEMMs, the CUDA stage's host work) get the same
        # thread count as the kernels, so the two never oversubscribe the cores.
        torch.set_num_threads(placement.cpu_threads)
    choice = _kernel_choice(placement, config, backend)
    reader = CheckpointReader(model_dir)
    try:
        stream = "auto" if streamed_prefill is None else streamed_prefill
        stages = [_load_stage(reader, config, spec, placement, backend, choice, kv_slab, stream)
                  for spec in placement.stages]
        _check_every_tensor_used(reader, config)
    finally:
        reader.close()
    for stage in stages:
        if isinstance(stage.fused, ResidentDecode):
            stage.fused.capture(*_decode_buckets(placement, config))
    return LoadedModel(config, stages, placement, model_dir)


def _decode_buckets(placement: Placement, config: ModelConfig) -> tuple[int, int]:
    """(rows, pages per sequence) the GPU stage's decode graphs are captured up to: the running
    batch an engine with a GPU stage allows (the sequences the plan's KV budget holds, short
    requests sharing its pages: the plan prices the graphs' memory for them), each up to the
    plan's context (without a plan: the device pool's pages, the model's context)."""
    context = placement.context_tokens or config.max_position_embeddings
    rows = placement.max_running or min(placement.device_kv_pages or 1, MAX_RUNNING_SEQUENCES)
    return rows, -(-context // placement.page_size_tokens)


def _kernel_choice(placement: Placement, config: ModelConfig, backend: str) -> tuple[dict, int]:
    """(prompt-GEMM routes, attention kernel's longest query chunk) for the CPU stages: the
    plan's, where its machine profile measured them with the kernels and threads that run here;
    else measured now on this model's own shapes."""
    if backend != "helm" or not any(resolve_device(s.device).type == "cpu" for s in placement.stages):
        return {}, 1
    from executor.kernels import KERNEL_ISA
    threads = placement.cpu_threads or torch.get_num_threads()
    choice = placement.kernel_choice
    if choice is not None and (choice.isa, choice.threads) == (KERNEL_ISA, threads):
        routes = {DTYPES[name]: (path, rows) for name, path, rows in choice.gemm_routes}
        return routes, choice.attention_max_queries
    if choice is not None:
        why = (f"the plan's profile measured the kernels as {choice.isa} with {choice.threads} threads, "
               f"here they run as {KERNEL_ISA} with {threads}")
    else:
        why = "no plan measured this machine's kernels"
    routes, max_queries = measured_choice(config, threads)
    log.info("%s: measured at load: prompt GEMM routes %s, attention kernel up to %d queries", why,
             {str(d).removeprefix("torch."): r for d, r in routes.items()} or "gemv", max_queries)
    return routes, max_queries


def _check_every_tensor_used(reader: CheckpointReader, cfg: ModelConfig) -> None:
    """A checkpoint tensor the model did not read is a weight its computation would leave out
    (a bias this config did not say, a layer beyond num_hidden_layers): refused, not run without
    it. Rotary tables are derived, and a tied lm_head.weight may be stored as the embedding's
    copy (transformers unties the two where they differ, so a different one is refused too)."""
    unread = [n for n in reader.names() if n not in reader.read and not n.endswith("rotary_emb.inv_freq")]
    if cfg.tie_word_embeddings and "lm_head.weight" in unread:
        if not reader.same_bytes("lm_head.weight", "model.embed_tokens.weight"):
            raise WeightsError("config.json ties the output projection to the embedding (tie_word_embeddings), "
                               "but the checkpoint's lm_head.weight differs from it: transformers would use "
                               "lm_head.weight; set tie_word_embeddings to false")
        unread.remove("lm_head.weight")
    if unread:
        more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
        raise WeightsError(f"the checkpoint holds tensors this config does not use: {', '.join(unread[:5])}{more}; "
                           "the model would run without them (config.json and the weights disagree)")


def _load_stage(reader: CheckpointReader, cfg: ModelConfig, spec: StageSpec, placement: Placement,
                backend: str, choice: tuple[dict, int], kv_slab: bool | None, stream: bool | str) -> Stage:
    device = resolve_device(spec.device)
    if spec.device == "cuda" and device.type == "cpu":
        log.info("no CUDA device: the GPU stage (units %d..%d) runs its code on the CPU",
                 spec.unit_start, spec.unit_end - 1)
    wdtype, f32 = cfg.dtype, torch.float32
    H, V, D, I = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.intermediate_size
    ops = make_backend(backend, device, placement.cpu_threads, *choice,
                       fused_prompt=placement.flash_attention is not False)
    gpu = resolve_device("cuda")
    if stream == "auto":  # where there is CUDA, and flash attention runs there for this model
        stream = gpu.type == "cuda"
        if stream and spec.device == "cpu" and placement.stream_prefill_min_rows is not None and \
                not flash_attention_runs(gpu, wdtype, cfg.num_heads, cfg.num_kv_heads, D):
            # the chunks' attention over their cached keys takes flash attention, as the GPU
            # stage's do: anything else builds a chunk × context mask the plan did not price
            log.warning("the plan streams the CPU stage's prompt steps to the GPU, but flash attention does not "
                        "run this model's %s attention there: they run on the CPU", str(wdtype).removeprefix("torch."))
            stream = False
    # a CPU stage whose prompt steps the plan streams to the GPU: its projections on pages of
    # their own, which can be page-locked where they are (executor/streamed_prefill.py)
    streams = stream and spec.device == "cpu" and placement.stream_prefill_min_rows is not None and \
        spec.unit_start < cfg.num_layers + 1 and spec.unit_end > 1

    def get(name, shape, dtype=wdtype):
        return reader.get(name, shape, dtype, device)

    def fused(parts, dtype=wdtype, streamed=False):
        """Tensors [(name, shape)] stacked along dim 0, each read into its rows of one buffer
        (streamed: a projection a streaming stage copies to the GPU, on pages of its own)."""
        if device.type != "cpu":
            return torch.cat([get(name, shape, dtype) for name, shape in parts])
        shape = (sum(shape[0] for _, shape in parts), *parts[0][1][1:])
        out = page_aligned(shape, dtype) if streamed and streams else torch.empty(shape, dtype=dtype)
        row = 0
        for name, shape in parts:
            reader.get(name, shape, dtype, device, out=out[row:row + shape[0]])
            row += shape[0]
        return out

    embedding = None
    if spec.unit_start == 0:
        embedding = get("model.embed_tokens.weight", (V, H))

    blocks = []
    for layer in range(max(spec.unit_start, 1) - 1, min(spec.unit_end, cfg.num_layers + 1) - 1):
        p = f"model.layers.{layer}."
        qkv = fused([(p + "self_attn.q_proj.weight", (cfg.q_dim, H)),
                     (p + "self_attn.k_proj.weight", (cfg.kv_dim, H)),
                     (p + "self_attn.v_proj.weight", (cfg.kv_dim, H))], streamed=True)
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = fused([(p + "self_attn.q_proj.bias", (cfg.q_dim,)),
                              (p + "self_attn.k_proj.bias", (cfg.kv_dim,)),
                              (p + "self_attn.v_proj.bias", (cfg.kv_dim,))], f32)
        gate_up = fused([(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H))], streamed=True)
        blocks.append(BlockWeights.of(
            ops,
            input_norm=get(p + "input_layernorm.weight", (H,), f32),
            qkv=qkv, qkv_bias=qkv_bias,
            q_norm=get(p + "self_attn.q_norm.weight", (D,), f32) if cfg.qk_norm else None,
            k_norm=get(p + "self_attn.k_norm.weight", (D,), f32) if cfg.qk_norm else None,
            o=fused([(p + "self_attn.o_proj.weight", (H, cfg.q_dim))], streamed=True),
            post_norm=get(p + "post_attention_layernorm.weight", (H,), f32),
            gate_up=gate_up,
            down=fused([(p + "mlp.down_proj.weight", (H, I))], streamed=True),
        ))

    head = None
    if spec.unit_end == cfg.num_units:
        if cfg.tie_word_embeddings and embedding is not None:
            lm_head = embedding  # same stage: share the tensor
        elif cfg.tie_word_embeddings:
            lm_head = get("model.embed_tokens.weight", (V, H))
        else:
            lm_head = get("lm_head.weight", (V, H))
        head = HeadWeights(norm=get("model.norm.weight", (H,), f32), lm_head=ops.linear(lm_head, None))

    kv = None
    if blocks:
        device_pages, host_pages = kv_pools(placement, spec.device)
        slab = spec.device == "cuda" and bool(device_pages) and (
            device.type == "cuda" if kv_slab is None else kv_slab)
        kv = KVCache(
            num_layers=len(blocks), num_kv_heads=cfg.num_kv_heads, head_dim=D, dtype=wdtype, device=device,
            page_size=placement.page_size_tokens, device_pages=device_pages, host_pages=host_pages, slab=slab,
            pin_pages=streams,  # copied to and from the GPU by the streamed prompt steps
        )
    streamed = None
    if streams and blocks:
        try:
            streamed = StreamedPrefill(cfg, blocks, kv, gpu, placement.stream_prefill_min_rows)
            log.info("CPU stage units %d..%d: prompt steps of >= %d tokens run on %s, %s of weights streamed "
                     "through a %s ring", spec.unit_start, spec.unit_end - 1, streamed.min_rows, gpu,
                     fmt_bytes(streamed.weight_bytes), fmt_bytes(streamed.device_bytes))
        except MemoryError as e:  # page-locking refused (a locked-memory limit): slower, not broken
            log.warning("the plan streams the CPU stage's prompt steps to the GPU, but %s: they run on the CPU", e)
            kv.device_pool.unpin()  # nothing copies its pages to the GPU then
    return Stage(cfg, spec.unit_start, spec.unit_end, device, embedding, blocks, head, kv, ops, streamed=streamed)
