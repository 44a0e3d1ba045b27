"""Every tensor a config implies, and its values: drawn reproducibly, one chunk at a time.

Weight initialisation. Hugging Face's own init scale (every matrix std 0.02, norms 1) makes random
models degenerate: greedy decoding repeats one token forever (the distinct-token counts of both
schemes are in README "Random-weight checkpoints"). Each tensor is drawn uniformly with a mean and
std (uniform for bit-exact portability, see `value_chunks`):
  * q_proj, k_proj: std QK_GAIN/sqrt(fan_in); Qwen3 q_norm/k_norm: mean QK_GAIN. With q and k
    entries of rms 2, attention scores have std ≈ 4: attention picks out particular tokens instead
    of averaging the context into a slowly changing vector;
  * v_proj, o_proj, gate/up/down_proj: std 1/sqrt(fan_in), so each block adds rms ≈ 1 to the
    residual at any width and the blocks, not the input embedding, dominate it;
  * embed_tokens and lm_head: std EMBED_STD_SCALE/sqrt(hidden) (rms 1/sqrt(hidden) per entry). A
    tied model whose residual were mostly its input embedding would score that token highest and
    repeat it forever;
  * final norm: mean LOGIT_STD/EMBED_STD_SCALE = 3, so logits have std ≈ 3, a trained LM's spread;
  * other RMSNorm scales: mean 1 (× the gain above) with NORM_NOISE_STD = 10 % relative noise, so
    mixing up two norms changes the output;
  * biases (Qwen2 q/k/v, or any bias an override enables): std BIAS_STD, large enough that
    dropping one changes the greedy tokens within a few steps (k's bias matters because RoPE
    rotates it), small enough that v's bias does not add one vector at every position.
Each tensor has its own torch.Generator seeded from sha256(seed, tensor name), so its values do not
depend on which other tensors exist, their order, the dtype (values are drawn in fp32, then cast) or
the shard size.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from tools.checkpoint import DTYPES, MakeModelError
from tools.checkpoint.configs import FAMILIES, head_dim

EMBED_STD_SCALE = 1.0  # embed_tokens / lm_head std = EMBED_STD_SCALE / sqrt(hidden)
LOGIT_STD = 3.0  # logits std ≈ final-norm scale × EMBED_STD_SCALE, so model.norm ≈ 3
QK_GAIN = 2.0  # q and k entries have rms QK_GAIN, so attention scores have std ≈ QK_GAIN²
NORM_NOISE_STD = 0.1  # RMSNorm scales: gain × (1 + noise of std NORM_NOISE_STD)
BIAS_STD = 0.1
GEN_CHUNK_ELEMS = 1 << 22  # values are drawn in chunks of 4 Mi elements (16 MiB of fp32)


# ----------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its Hugging Face name, shape and the distribution of its values
    (uniform with this mean and standard deviation, see `value_chunks`)."""

    name: str
    shape: tuple[int, ...]
    mean: float  # 0 for matrices and biases, the gain (≈ 1) for RMSNorm scales
    std: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Every tensor of the checkpoint, named exactly as Hugging Face names them, in model order,
    with the normal each is drawn from (the scheme is explained in the module docstring)."""
    arch = config["model_type"]
    if arch not in FAMILIES:
        raise MakeModelError(f"unsupported model_type {arch!r}")
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = head_dim(config)
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    # Which biases exist: Qwen2 always has q/k/v biases (no o bias); Llama and Qwen3 have q/k/v/o
    # biases when attention_bias is true (Mistral never has any); Llama has MLP biases when
    # mlp_bias is true.
    o_bias = arch in ("llama", "qwen3") and bool(config.get("attention_bias"))
    qkv_bias = arch == "qwen2" or o_bias
    mlp_bias = bool(config.get("mlp_bias"))

    def linear(name: str, out_f: int, in_f: int, bias: bool, gain: float = 1.0) -> list[TensorSpec]:
        specs = [TensorSpec(f"{name}.weight", (out_f, in_f), 0.0, gain / math.sqrt(in_f))]
        if bias:
            specs.append(TensorSpec(f"{name}.bias", (out_f,), 0.0, BIAS_STD))
        return specs

    def norm(name: str, width: int, gain: float = 1.0) -> TensorSpec:
        return TensorSpec(f"{name}.weight", (width,), gain, gain * NORM_NOISE_STD)

    embed_std = EMBED_STD_SCALE / math.sqrt(h)
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, h), 0.0, embed_std)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs.append(norm(f"{p}.input_layernorm", h))
        specs += linear(f"{p}.self_attn.q_proj", q_out, h, qkv_bias, gain=QK_GAIN)  # q: [.., H*D]
        specs += linear(f"{p}.self_attn.k_proj", kv_out, h, qkv_bias, gain=QK_GAIN)
        specs += linear(f"{p}.self_attn.v_proj", kv_out, h, qkv_bias)
        specs += linear(f"{p}.self_attn.o_proj", h, q_out, o_bias)
        if arch == "qwen3":  # per-head RMSNorm of q and k: it, not q_proj, sets their scale
            specs.append(norm(f"{p}.self_attn.q_norm", hd, gain=QK_GAIN))
            specs.append(norm(f"{p}.self_attn.k_norm", hd, gain=QK_GAIN))
        specs.append(norm(f"{p}.post_attention_layernorm", h))
        specs += linear(f"{p}.mlp.gate_proj", inter, h, mlp_bias)
        specs += linear(f"{p}.mlp.up_proj", inter, h, mlp_bias)
        specs += linear(f"{p}.mlp.down_proj", h, inter, mlp_bias)
    specs.append(norm("model.norm", h, gain=LOGIT_STD / EMBED_STD_SCALE))
    if not config.get("tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (vocab, h), 0.0, embed_std))
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"helm.make_model/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes a 63-bit int


def value_chunks(spec: TensorSpec, seed: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor's values, flattened, in chunks of at most GEN_CHUNK_ELEMS.

    Values are uniform on mean ± sqrt(3)·std (PyTorch's own nn.Linear init is uniform too), drawn
    in fp32 and then cast to `dtype`. Uniform rather than normal for portability: torch.rand
    yields k / 2^24 from the Mersenne Twister on every CPU, and the affine map below is three
    separately rounded IEEE operations, so the bits are the same on any machine; torch.randn runs
    different code (and gives different bits) on AVX2 and on other CPUs.
    """
    gen = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    width = 2.0 * math.sqrt(3.0) * spec.std
    for start in range(0, spec.numel, GEN_CHUNK_ELEMS):
        x = torch.rand(min(GEN_CHUNK_ELEMS, spec.numel - start), generator=gen)  # [n] in [0, 1)
        x.sub_(0.5).mul_(width).add_(spec.mean)
        yield x.to(dtype)


def materialize(spec: TensorSpec, seed: int, dtype: str = "fp32") -> torch.Tensor:
    """The whole tensor in memory: the reference twin of what the writer streams to disk."""
    return torch.cat(list(value_chunks(spec, seed, DTYPES[dtype][0]))).view(spec.shape)
