"""The plan's price for the GPU stage's activations (planner/working_set.py) against what the
executor's own decoder block holds: its code on the meta device, the branch it takes for weights
off the CPU (CUDA's), every allocation counted while it is alive. The price comes from the traced
model graph; the measurement from the executor's code: two independent accounts of one block."""
import json
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from executor.attention import TorchAttention, streaming_attention
from executor.backends import TorchBackend
from executor.model_config import ModelConfig
from executor.stage import BlockWeights
from executor.torch_ops import decoder_block
from planner.step_shape import PREFILL_CHUNK_TOKENS
from planner.trace import trace_model
from planner.working_set import activation_bytes_per_token, streamed_prompt_attention_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "tools" / "model_configs"
META = torch.device("meta")


class LiveBytes(TorchDispatchMode):
    """The most bytes of op outputs' storage alive at once: a storage counts from the op that
    made it until the last tensor on it is collected (a view, an in-place write, or an op such as
    _unsafe_view that returns its input's storage under another name adds nothing; views of
    tensors made before, such as a weight's transpose, are not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.tensors: dict[int, int] = {}  # storage -> its tensors alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.tensors:
                    if aliases:
                        continue
                    self.tensors[key] = 0
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self.tensors[key] += 1
                weakref.finalize(t, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, size: int) -> None:
        self.tensors[key] -= 1
        if not self.tensors[key]:
            del self.tensors[key]
            self.live -= size


def _block_peak(cfg: ModelConfig, tokens: int) -> int:
    """Peak bytes the executor's decoder block allocates for a prompt chunk of `tokens`, its input
    held by the caller as in a stage. Attention is the GPU stage's fused path up to the kernel:
    q/k norms and rotary (qkv in the weights' dtype, as the loader builds a GPU stage's
    projection without a bias), K/V in the cache's dtype, q cast for SDPA, the kernel's output in
    that dtype and its copy back into the step's fp32 output. The flash and memory-efficient
    kernels keep no scores, and the gathered K/V are priced apart (gpu_working_bytes)."""
    wd, H, D = cfg.dtype, cfg.hidden_size, cfg.head_dim

    def vec(n):
        return torch.empty(n, device=META)

    def weight(rows, cols):
        return torch.empty(rows, cols, dtype=wd, device=META)

    ops = TorchBackend()
    w = BlockWeights.of(ops, input_norm=vec(H), qkv=weight(cfg.q_dim + 2 * cfg.kv_dim, H), qkv_bias=None,
                        q_norm=vec(D) if cfg.qk_norm else None, k_norm=vec(D) if cfg.qk_norm else None,
                        o=weight(H, cfg.q_dim), post_norm=vec(H), gate_up=weight(2 * cfg.intermediate_size, H),
                        down=weight(H, cfg.intermediate_size))
    attention = TorchAttention(cfg, None, ops)
    cos = sin = torch.empty(tokens, D, device=META)

    def attend(qkv):
        qk, v = attention.project(qkv, w.q_norm, w.k_norm, cos, sin)
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        out = torch.empty(tokens, cfg.num_heads, D, device=META)
        k.to(wd), v.to(wd)  # written into the cache's pages
        qh = q.transpose(0, 1).to(wd)
        kernel = torch.empty_like(qh)  # what SDPA returns for qh
        out[:] = kernel.transpose(0, 1).reshape(tokens, cfg.num_heads, D)
        del qh, kernel
        return out.reshape(tokens, cfg.q_dim)

    with LiveBytes() as live:
        x = torch.empty(tokens, H, device=META)  # the residual stream: the graph's count has it too
        decoder_block(x, w, ops, cfg, attend)
    return live.peak


@pytest.mark.parametrize("model,dtype", [("qwen3-8b", None), ("llama-3.1-8b", None), ("qwen2.5-7b", None),
                                         ("mistral-7b-v0.3", None), ("qwen3-0.6b", None), ("qwen3-0.6b", "float32")])
def test_activation_price_covers_the_executors_block_closely(model, dtype):
    raw = json.loads((CONFIGS / f"{model}.json").read_text())
    if dtype is not None:
        raw["torch_dtype"] = dtype
    cfg = ModelConfig.from_dict(raw)
    ir = trace_model(raw)
    priced = activation_bytes_per_token(ir.units[1:2])
    measured = _block_peak(cfg, PREFILL_CHUNK_TOKENS) / PREFILL_CHUNK_TOKENS
    assert measured <= priced <= 1.25 * measured, (model, ir.dtype, measured, priced)


def _streamed_peak(cfg: ModelConfig, tokens: int, page: int, pages: int) -> int:
    """Peak bytes of a prompt chunk of `tokens` queries (the last ones of `pages` pages) through
    streaming_attention, as a stage whose sequence has pages on the host runs it: each page copied
    to the device as it comes, the next one already on its way (KVCache.chunks prefetches)."""
    H_kv, D = cfg.num_kv_heads, cfg.head_dim

    def device_pages():
        nxt = None
        for i in range(pages + 1):
            cur, nxt = nxt, (torch.empty(H_kv, page, D, dtype=cfg.dtype, device=META),
                             torch.empty(H_kv, page, D, dtype=cfg.dtype, device=META), i * page)
            if cur is not None:
                yield cur

    q = torch.empty(tokens, cfg.num_heads, D, device=META)  # an activation: priced apart
    first = pages * page - tokens
    with LiveBytes() as live:
        positions = torch.arange(first, first + tokens, device=META)
        out = streaming_attention(q, device_pages(), D ** -0.5, positions, first_query=first)
        del out, positions
    return live.peak


@pytest.mark.parametrize("model", ["qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-0.6b"])
def test_streamed_prompt_attention_price_covers_the_executors_closely(model):
    raw = json.loads((CONFIGS / f"{model}.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    block = trace_model(raw).units[1]
    group = cfg.num_heads // cfg.num_kv_heads
    for tokens, page, pages in ((PREFILL_CHUNK_TOKENS, 512, 4), (PREFILL_CHUNK_TOKENS, 64, 12), (300, 512, 1)):
        priced = streamed_prompt_attention_bytes(tokens, page, block.kv_bytes_per_token, block.attn_heads, group,
                                                 block.attn_flops_per_context_token, 2)
        measured = _streamed_peak(cfg, tokens, page, pages)
        # a sequence of one page takes a shorter path (no running output, no next page): a bound there
        tight = 1.3 if pages > 1 else 2.0
        assert measured <= priced <= tight * measured, (model, tokens, page, pages, measured, priced)
