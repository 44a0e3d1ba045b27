"""Build Hugging Face checkpoints with real architectures and random weights, because nothing can be
downloaded from a model hub (DESIGN.md §9).

Contract: `make_model(arch, size, ...)` writes a directory laid out exactly like a downloaded checkpoint
(config.json, generation_config.json, model.safetensors or index + shards, tokenizer.json,
tokenizer_config.json) that transformers and HELM load unchanged; the same arguments always give
byte-identical files, and weights are streamed to disk one chunk at a time, never held whole in memory.

    python tools/make_model.py --arch qwen3 --size tiny --dtype fp32 --seed 0 --out /tmp/tiny-qwen3
    python tools/make_model.py --size qwen3-1.7b --out /tmp/qwen3-1.7b        # --arch defaults to family

Weight initialisation. Hugging Face's own init scale (every matrix std 0.02, norms 1) makes random
models degenerate. Measured with greedy decoding in transformers (32 new tokens after 20 random
prompt tokens; 12 runs per tiny family, 4 per real-width model): the scheme below gives 28.5-29.2
distinct tokens out of 32 (worst run 24) for the four tiny models, and 29.5-32 (worst 26) at real
widths (qwen3-0.6b at full depth; qwen3-1.7b, llama-3.2-1b, qwen2.5-7b, mistral-7b cut to 2-6
layers); HF's scale gives 1.0-1.2 for tied tiny Qwen3/Llama (one token forever), 13-18 for untied
tiny Qwen2/Mistral and 2.3 at qwen3-0.6b widths. Each tensor is drawn uniformly with a mean and std
(uniform for bit-exact portability, see `_chunks`):
  * q_proj, k_proj: std QK_GAIN/sqrt(fan_in); Qwen3 q_norm/k_norm: mean QK_GAIN. With q and k
    entries of rms 2, attention scores have std ≈ 4: attention picks out particular tokens instead
    of averaging the context into a slowly changing vector (at gain 1: 10-20 distinct on tiny
    models, 4.7 at qwen3-0.6b widths, some runs stuck on one token);
  * v_proj, o_proj, gate/up/down_proj: std 1/sqrt(fan_in), so each block adds rms ≈ 1 to the
    residual at any width and the blocks, not the input embedding, dominate it;
  * embed_tokens and lm_head: std EMBED_STD_SCALE/sqrt(hidden) (rms 1/sqrt(hidden) per entry). A
    tied model whose residual were mostly its input embedding would score that token highest and
    repeat it forever;
  * final norm: mean LOGIT_STD/EMBED_STD_SCALE = 3, so logits have std ≈ 3, a trained LM's spread;
  * other RMSNorm scales: mean 1 (× the gain above) with NORM_NOISE_STD = 10 % relative noise, so
    mixing up two norms changes the output;
  * biases (Qwen2 q/k/v, or any bias an override enables): std 0.1 — dropping the q, k or v bias
    of tiny qwen2 moves its logits by 0.15-1.0 on average and changes its greedy tokens within 6
    steps (k's bias matters because RoPE rotates it); std 0.5 gave qwen2 only 6-8 distinct tokens
    (v's bias adds the same vector at every position).
Each tensor has its own torch.Generator seeded from sha256(seed, tensor name), so its values do not
depend on which other tensors exist, their order, the dtype (values are drawn in fp32, then cast) or
the shard size.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

__all__ = [
    "ARCHS",
    "DTYPES",
    "MakeModelError",
    "TensorSpec",
    "build_config",
    "build_tokenizer",
    "make_model",
    "materialize",
    "parse_size",
    "preset_names",
    "tensor_specs",
]

PRESET_DIR = Path(__file__).resolve().parent / "model_configs"

# --dtype name -> (torch dtype, config.json torch_dtype, safetensors dtype tag)
DTYPES: dict[str, tuple[torch.dtype, str, str]] = {
    "bf16": (torch.bfloat16, "bfloat16", "BF16"),
    "fp16": (torch.float16, "float16", "F16"),
    "fp32": (torch.float32, "float32", "F32"),
}

DEFAULT_SHARD_SIZE_BYTES = 2 * 10**9  # "2GB", the Hugging Face default (GB = 10^9 bytes)
# Weight initialisation (see the module docstring for why and for the measurements).
EMBED_STD_SCALE = 1.0  # embed_tokens / lm_head std = EMBED_STD_SCALE / sqrt(hidden)
LOGIT_STD = 3.0  # logits std ≈ final-norm scale × EMBED_STD_SCALE, so model.norm ≈ 3
QK_GAIN = 2.0  # q and k entries have rms QK_GAIN, so attention scores have std ≈ QK_GAIN²
NORM_NOISE_STD = 0.1  # RMSNorm scales: gain × (1 + noise of std NORM_NOISE_STD)
BIAS_STD = 0.1
GEN_CHUNK_ELEMS = 1 << 22  # values are drawn in chunks of 4 Mi elements (16 MiB of fp32)
PROGRESS_MIN_BYTES = 256 * 2**20  # show progress on stderr for checkpoints at least this big
PROGRESS_EVERY_S = 2.0


class MakeModelError(ValueError):
    """A bad request (unknown arch/size/dtype, inconsistent overrides, occupied --out ...)."""


# ----------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class Family:
    """What differs between the four supported architectures, beyond config.json values."""

    arch: str  # --arch name == config.json model_type
    reference: str  # preset whose config.json field set (and non-dimension values) `tiny` copies
    tiny: dict  # config fields that turn the reference preset into the tiny model
    specials: tuple[tuple[str, int], ...]  # (special token, id offset from the anchor)
    anchor_at_bos: bool  # True: offsets count from bos_token_id (Qwen, Llama 3); False: from id 0
    prepend_bos: bool  # does the tokenizer add the bos token to encoded text (Llama, Mistral)
    qwen_pretokenizer: bool  # Qwen's pipeline (NFC, digits split one by one), else Llama 3's
    pad_token: str | None  # special token used as padding, if the family has one
    unk_token: str | None


_TINY_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
}

FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        arch="qwen3",
        reference="qwen3-0.6b",
        # head_dim 32 with 4 heads: q is 128 wide for a 64-wide residual, like Qwen3-0.6B
        # (16 x 128 = 2048 for hidden 1024), so head_dim != hidden / heads is exercised.
        tiny={**_TINY_COMMON, "head_dim": 32, "intermediate_size": 192,
              "bos_token_id": 1000, "eos_token_id": 1002},
        specials=(("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)),
        anchor_at_bos=True, prepend_bos=False, qwen_pretokenizer=True,
        pad_token="<|endoftext|>", unk_token=None,
    ),
    "llama": Family(
        arch="llama",
        reference="llama-3.2-1b",
        # llama3 rope scaling with original_max_position_embeddings 64: for head_dim 16 and theta
        # 5e5 the 8 frequencies fall in all three regimes (kept, smoothed, divided by factor)
        # within a few dozen positions, so short test prompts exercise the whole formula.
        tiny={**_TINY_COMMON, "head_dim": 16, "intermediate_size": 128,
              "bos_token_id": 1000, "eos_token_id": 1001,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 64, "rope_type": "llama3"}},
        specials=(("<|begin_of_text|>", 0), ("<|end_of_text|>", 1), ("<|start_header_id|>", 6),
                  ("<|end_header_id|>", 7), ("<|eot_id|>", 9)),
        anchor_at_bos=True, prepend_bos=True, qwen_pretokenizer=False,
        pad_token=None, unk_token=None,
    ),
    "qwen2": Family(
        arch="qwen2",
        reference="qwen2.5-7b",
        # Like Qwen2.5: sliding_window is set but use_sliding_window is false (not used).
        tiny={**_TINY_COMMON, "intermediate_size": 176, "bos_token_id": 1000,
              "eos_token_id": 1002, "sliding_window": 2048, "max_window_layers": 4},
        specials=(("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)),
        anchor_at_bos=True, prepend_bos=False, qwen_pretokenizer=True,
        pad_token="<|endoftext|>", unk_token=None,
    ),
    "mistral": Family(
        arch="mistral",
        reference="mistral-7b-v0.3",
        tiny={**_TINY_COMMON, "head_dim": 16, "intermediate_size": 160,
              "bos_token_id": 1, "eos_token_id": 2},
        specials=(("<unk>", 0), ("<s>", 1), ("</s>", 2), ("[INST]", 3), ("[/INST]", 4)),
        anchor_at_bos=False, prepend_bos=True, qwen_pretokenizer=False,
        pad_token=None, unk_token="<unk>",
    ),
}
ARCHS: tuple[str, ...] = tuple(FAMILIES)

# Fields that select the architecture or the dtype: set through arch/size/dtype, not overrides.
_NOT_OVERRIDABLE = {"architectures", "model_type", "torch_dtype", "dtype"}


# ----------------------------------------------------------------------------------------------
# Configs


@functools.lru_cache(maxsize=1)
def _presets() -> dict[str, dict]:
    presets = {}
    for path in sorted(PRESET_DIR.glob("*.json")):
        presets[path.stem] = json.loads(path.read_text())
    return presets


def preset_names() -> list[str]:
    """Real-dimension sizes (the stems of tools/model_configs/*.json)."""
    return list(_presets())


def _preset(name: str) -> dict:
    return json.loads(json.dumps(_presets()[name]))  # a deep copy callers may edit


def _family_of_preset(name: str) -> str:
    model_type = _presets()[name]["model_type"]
    if model_type not in FAMILIES:
        raise MakeModelError(f"preset {name!r} has model_type {model_type!r}, not one of {ARCHS}")
    return model_type


def _eos_ids(config: dict) -> list[int]:
    eos = config.get("eos_token_id")
    return list(eos) if isinstance(eos, list) else [eos]


def _known_config_fields(model_type: str) -> set[str]:
    from transformers import AutoConfig  # slow import, only needed for unusual overrides

    return set(AutoConfig.for_model(model_type).to_dict()) | {"rope_scaling", "rope_theta"}


def build_config(arch: str | None, size: str, dtype: str = "bf16",
                 overrides: dict | None = None) -> dict:
    """config.json contents for (arch, size, dtype) with `overrides` patched in, validated.

    The field set is the one of the family's real checkpoint (tools/model_configs); a real preset
    keeps its values exactly, apart from torch_dtype and the overrides.
    """
    if dtype not in DTYPES:
        raise MakeModelError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if arch is not None and arch not in FAMILIES:
        raise MakeModelError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if size == "tiny":
        if arch is None:
            raise MakeModelError(f"size 'tiny' needs an arch: one of {', '.join(ARCHS)}")
        config = _preset(FAMILIES[arch].reference)
        config.update(json.loads(json.dumps(FAMILIES[arch].tiny)))
    elif size in _presets():
        family = _family_of_preset(size)
        if arch is not None and arch != family:
            raise MakeModelError(f"size {size!r} is a {family} model, but arch {arch!r} was given "
                                 f"(omit --arch or pass --arch {family})")
        arch = family
        config = _preset(size)
    else:
        raise MakeModelError(f"unknown size {size!r}: choose 'tiny' or one of "
                             f"{', '.join(preset_names())}")
    config["torch_dtype"] = DTYPES[dtype][1]

    overrides = dict(overrides or {})
    bad = sorted(set(overrides) & _NOT_OVERRIDABLE)
    if bad:
        raise MakeModelError(f"cannot override {bad}: use arch/size/dtype instead")
    unknown = sorted(k for k in overrides if k not in config)
    if unknown:
        unknown = sorted(set(unknown) - _known_config_fields(arch))
        if unknown:
            raise MakeModelError(f"unknown {arch} config field(s) in overrides: {unknown}")
    config.update(overrides)
    _validate_config(config)
    return dict(sorted(config.items()))


def _validate_config(c: dict) -> None:
    def positive_int(key: str) -> int:
        value = c.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MakeModelError(f"config field {key} must be a positive integer, got {value!r}")
        return value

    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        positive_int(key)
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    if heads % kv_heads:
        raise MakeModelError(f"num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
    if c.get("head_dim") is None and c["hidden_size"] % heads:
        raise MakeModelError(f"hidden_size {c['hidden_size']} is not a multiple of "
                             f"num_attention_heads {heads} and no head_dim is given")
    if c.get("head_dim") is not None:
        positive_int("head_dim")
    if _head_dim(c) % 2:
        raise MakeModelError(f"head_dim {_head_dim(c)} is odd: RoPE rotates pairs of dimensions")
    vocab = c["vocab_size"]
    for key, ids in (("bos_token_id", [c.get("bos_token_id")]), ("eos_token_id", _eos_ids(c))):
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < vocab:
                raise MakeModelError(f"{key} {c.get(key)!r} does not fit vocab_size {vocab}; "
                                     f"override {key} too")
    rope = c.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise MakeModelError(f"rope_scaling must be an object or null, got {rope!r}")


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


# ----------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its Hugging Face name, shape and the distribution of its values
    (uniform with this mean and standard deviation, see `_chunks`)."""

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
    hd = _head_dim(config)
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    # Which biases exist: Qwen2 always has q/k/v biases (no o bias); Llama and Qwen3 have q/k/v/o
    # biases when attention_bias is true; Llama has MLP biases when mlp_bias is true.
    qkv_bias = arch == "qwen2" or bool(config.get("attention_bias"))
    o_bias = arch != "qwen2" and bool(config.get("attention_bias"))
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


def _chunks(spec: TensorSpec, seed: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
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
    return torch.cat(list(_chunks(spec, seed, DTYPES[dtype][0]))).view(spec.shape)


# ----------------------------------------------------------------------------------------------
# safetensors writing


def parse_size(text: str | int) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, '123' -> 123 (Hugging Face units)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise MakeModelError(f"bad size {text!r}: expected e.g. 2GB, 500MB, 1GiB or bytes")
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
        value = int(float(m.group(1)) * scale)
    if value < 1:
        raise MakeModelError(f"shard size must be positive, got {text!r}")
    return value


def _plan_shards(specs: list[TensorSpec], itemsize: int,
                 shard_size_bytes: int) -> list[list[TensorSpec]]:
    """Hugging Face's rule: start a new shard when the next tensor would overflow this one."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and used + nbytes > shard_size_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += nbytes
    return shards


class _Progress:
    """Progress lines on stderr (for big checkpoints only), at most one every PROGRESS_EVERY_S."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.done, self.enabled = total_bytes, 0, enabled
        self.t0 = self.last = time.monotonic()

    def advance(self, nbytes: int, where: str) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last >= PROGRESS_EVERY_S or self.done == self.total):
            self.last = now
            print(f"make_model: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                  f"({100 * self.done / self.total:.0f}%) {where}, {now - self.t0:.1f} s",
                  file=sys.stderr, flush=True)


def _write_safetensors(path: Path, specs: list[TensorSpec], seed: int, dtype: str,
                       progress: _Progress, where: str) -> None:
    """Stream one safetensors file: header first (offsets are known from shapes), then each tensor
    chunk by chunk, so peak memory is one chunk, not one shard. Written to a temp name, then renamed."""
    torch_dtype, _, tag = DTYPES[dtype]
    itemsize = torch.tensor([], dtype=torch_dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        header[spec.name] = {"dtype": tag, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec in specs:
            for chunk in _chunks(spec, seed, torch_dtype):
                f.write(memoryview(chunk.view(torch.uint8).numpy()))
                progress.advance(chunk.numel() * itemsize, where)
    os.replace(tmp, path)


def _write_weights(out: Path, config: dict, seed: int, dtype: str, shard_size_bytes: int,
                   progress: bool | None) -> None:
    specs = tensor_specs(config)
    itemsize = torch.tensor([], dtype=DTYPES[dtype][0]).element_size()
    total_bytes = sum(s.numel for s in specs) * itemsize
    shards = _plan_shards(specs, itemsize, shard_size_bytes)
    show = total_bytes >= PROGRESS_MIN_BYTES if progress is None else progress
    prog = _Progress(total_bytes, show)
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", specs, seed, dtype, prog, "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out / name, shard, seed, dtype, prog, f"shard {i}/{len(shards)}")
        weight_map.update({spec.name: name for spec in shard})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


# ----------------------------------------------------------------------------------------------
# Tokenizer


_PROSE = """\
The river town woke slowly. Fog sat on the water until the ferry bell rang at seven, and then the
market opened: bread, apples, rope, lamp oil, and news from the valley. Nobody in the town was in a
hurry, except the clockmaker, who was always late and always running.

A small machine can learn a great deal from a few pages of plain text. It sees that "the" is common,
that words are separated by spaces, that sentences end with a full stop, and that numbers such as
12, 345 and 2024 are written with digits. It does not know what any of it means. That is fine; it
only has to cut text into pieces that are easy to count.

"Where are you going?" asked the teacher. "To the library," said Mara, "because the old maps are
there, and I want to find the road that goes over the mountain." She packed a pencil, a notebook,
two oranges and a warm coat. It's a long walk, and she'd heard the weather would turn.

Rules for the workshop: 1) Keep the floor clean. 2) Put every tool back where you found it.
3) Never leave the stove burning. 4) If something breaks, tell someone; don't hide it!

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

In the spring the fields turned green, in the summer they turned gold, and in the autumn the farmers
brought the harvest home on long, slow carts. The children counted the carts: one, two, three, four,
five, six, seven, eight, nine, ten. The winter was quiet, cold and very dark.
"""

_NOUNS = ("river town market bridge teacher student garden window mountain village engine "
          "library morning evening winter summer letter story question answer machine "
          "computer program number table kitchen farmer harvest bottle candle forest road "
          "ship harbor island doctor patient music song voice child friend family house "
          "door wall street city country language memory signal problem idea answer stone "
          "cloud storm light shadow paper pencil").split()
_ADJECTIVES = ("old new small large quiet busy bright dark cold warm early late simple strange "
               "careful quick slow heavy light green golden silver empty full gentle loud "
               "narrow wide ancient modern honest clever tired happy").split()
_VERBS = ("opened closed found lost carried built painted watched followed answered asked "
          "remembered forgot counted measured repaired visited crossed climbed wrote read "
          "described explained noticed changed moved carried shared learned taught").split()
_ADVERBS = ("slowly quickly carefully quietly suddenly finally often never always rarely "
            "happily gently").split()
_PREPS = "across under over near behind beside inside through along toward without".split()
_NAMES = "Mara Tomas Elena Ravi Ingrid Omar Lucia Kenji Amara Pieter".split()


class _Lcg:
    """A tiny deterministic generator (Python's `random` could change between versions)."""

    def __init__(self, seed: int):
        self.state = seed

    def pick(self, items):
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) % 2**64
        return items[(self.state >> 33) % len(items)]


def _corpus() -> str:
    """~20 KB of English-ish text: the fixed prose above plus sentences from a small grammar."""
    rng = _Lcg(2024)
    lines = [_PROSE]
    for i in range(320):
        n1, n2, n3 = rng.pick(_NOUNS), rng.pick(_NOUNS), rng.pick(_NOUNS)
        a1, a2 = rng.pick(_ADJECTIVES), rng.pick(_ADJECTIVES)
        form = i % 6
        if form == 0:
            s = f"The {a1} {n1} {rng.pick(_VERBS)} the {n2} {rng.pick(_PREPS)} the {a2} {n3}."
        elif form == 1:
            s = f"{rng.pick(_NAMES)} {rng.pick(_ADVERBS)} {rng.pick(_VERBS)} a {a1} {n1}."
        elif form == 2:
            s = f"Why is the {n1} so {a1}? Because the {n2} is {a2}."
        elif form == 3:
            s = (f"In {1800 + (rng.state >> 20) % 225}, {(rng.state >> 40) % 97 + 2} {n1}s were "
                 f"{rng.pick(_VERBS)} near the {a1} {n2}.")
        elif form == 4:
            s = f"{rng.pick(_NAMES)} said, \"My {n1} is {a1}, and your {n2} is {a2}.\""
        else:
            s = f"def {rng.pick(_VERBS)}_{n1}({n2}, {n3}):\n    return {n2} + {n3}\n"
        lines.append(s)
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=16)
def _trained_bpe(num_tokens: int, qwen: bool) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """A byte-level BPE trained on `_corpus()` with at most `num_tokens` tokens, split by the
    Qwen (`qwen`) or Llama 3 pre-tokenizer.

    Returns (tokens, merges) in a canonical order that does not depend on how the trainer numbers
    its vocabulary: the 256 byte symbols in byte order, then each merge's result in merge order.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    _set_pipeline(tok, qwen)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=max(num_tokens, len(alphabet)), min_frequency=0,
                                  initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[])
    tok.train_from_iterator([_corpus()], trainer=trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    tokens = list(_byte_symbols())
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen and len(tokens) < num_tokens:
            tokens.append(a + b)
            seen.add(a + b)
    kept = [(a, b) for a, b in merges if a + b in seen]
    return tuple(tokens[:num_tokens]), tuple(kept)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map, in byte order: the alphabet of every byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


# Pre-tokenizer regexes of Llama 3 and of Qwen2/3 (which split numbers into single digits).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                 r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _set_pipeline(tok, qwen: bool) -> None:
    """Normalizer, pre-tokenizer and decoder of the real family tokenizer.

    Transformers 5 ignores tokenizer_class for model_type qwen2 and rebuilds Qwen2Tokenizer's own
    pipeline (NFC + the Qwen regex) around tokenizer.json's vocabulary and merges, so the Qwen
    pipeline here must be exactly that one for AutoTokenizer and tokenizers.Tokenizer to agree.
    """
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC() if qwen else None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT if qwen else _LLAMA3_SPLIT), behavior="isolated",
                             invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()


def _special_ids(config: dict) -> dict[int, str]:
    """id -> special token content, at the ids config.json gives bos/eos (optional extras that
    do not fit the vocabulary are left out)."""
    family = FAMILIES[config["model_type"]]
    anchor = config["bos_token_id"] if family.anchor_at_bos else 0
    specials = {anchor + off: content for content, off in family.specials
                if anchor + off < config["vocab_size"]}
    for key, ids in (("bos_token_id", [config["bos_token_id"]]),
                     ("eos_token_id", _eos_ids(config))):
        for i in ids:
            if i not in specials:
                raise MakeModelError(f"{key} {i} is not where the {family.arch} layout puts a "
                                     f"special token ({sorted(specials)})")
    return specials


def build_tokenizer(config: dict) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) for a config.

    A byte-level BPE trained on the embedded corpus fills the ids that are neither the family's
    special tokens nor beyond what the corpus supports; every other id below vocab_size is a
    reserved token `<|reserved_ID|>` placed directly in the BPE vocabulary (unreachable by merges,
    so it never appears when encoding text, but it decodes), so that every id decodes.
    """
    from tokenizers import AddedToken, Tokenizer, models, processors

    family = FAMILIES[config["model_type"]]
    vocab_size = config["vocab_size"]
    specials = _special_ids(config)
    if family.anchor_at_bos:  # BPE below the special tokens (Qwen, Llama 3)
        bpe_ids = range(0, min(specials))
    else:  # BPE after the special tokens (Mistral)
        bpe_ids = range(max(specials) + 1, vocab_size)
    if len(bpe_ids) < 256:
        raise MakeModelError(f"vocab_size {vocab_size} leaves {len(bpe_ids)} ids for the byte-level "
                             f"BPE, which needs at least 256 (one per byte)")
    tokens, merges = _trained_bpe(len(bpe_ids), family.qwen_pretokenizer)
    vocab = {tok: i for tok, i in zip(tokens, bpe_ids)}
    for i in range(vocab_size):
        if i in specials:
            vocab[specials[i]] = i
        elif i not in bpe_ids or i - bpe_ids.start >= len(tokens):
            vocab[f"<|reserved_{i}|>"] = i

    if len(vocab) != vocab_size:  # a trained token that collides with a special or reserved one
        raise AssertionError(f"tokenizer vocabulary has {len(vocab)} entries, not {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    _set_pipeline(tok, family.qwen_pretokenizer)
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                            for i in sorted(specials)])
    bos = specials[config["bos_token_id"]]
    if family.prepend_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, config["bos_token_id"])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer_config = {
        "add_bos_token": family.prepend_bos,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": specials[i], "lstrip": False, "normalized": False,
                     "rstrip": False, "single_word": False, "special": True}
            for i in sorted(specials)},
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": specials[_eos_ids(config)[0]],
        "model_max_length": config["max_position_embeddings"],
        "pad_token": family.pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    tokenizer_config["unk_token"] = family.unk_token  # null for Qwen, as in the real files
    return tok.to_str(pretty=True), tokenizer_config


def _generation_config(config: dict) -> dict:
    family = FAMILIES[config["model_type"]]
    eos = _eos_ids(config)
    gen = {"bos_token_id": config["bos_token_id"], "do_sample": False}
    if family.pad_token is not None:  # Qwen: <|endoftext|> also ends generation, and pads
        pad_id = next(i for i, t in _special_ids(config).items() if t == family.pad_token)
        eos = eos + [pad_id] if pad_id not in eos else eos
        gen["pad_token_id"] = pad_id
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return dict(sorted(gen.items()))


# ----------------------------------------------------------------------------------------------
# The checkpoint directory

_OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json")
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors(\.tmp)?")


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise MakeModelError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.iterdir())
    if existing and not force:
        raise MakeModelError(f"--out {out} is not empty ({', '.join(existing[:5])}"
                             f"{', ...' if len(existing) > 5 else ''}); pass --force to overwrite")
    # With force, remove only what an earlier build wrote; other files are left alone.
    for name in _OUTPUT_FILES:  # config.json first: it marks a complete build
        (out / name).unlink(missing_ok=True)
        (out / f"{name}.tmp").unlink(missing_ok=True)
    for p in out.iterdir():
        if _SHARD_RE.fullmatch(p.name):
            p.unlink()


def make_model(arch: str | None, size: str, dtype: str = "bf16", seed: int = 0,
               out: str | os.PathLike | None = None,
               shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES, overrides: dict | None = None,
               *, force: bool = False, config_only: bool = False,
               progress: bool | None = None) -> Path:
    """Write a random-weight checkpoint of `arch` at `size` ('tiny' or a preset name) to `out`.

    arch may be None for a preset (its family is used). `overrides` patch config.json fields
    (e.g. {"num_hidden_layers": 1, "rope_scaling": None}). `config_only` writes everything except
    the weights (for planning real sizes). `progress` None shows progress on stderr for
    checkpoints of PROGRESS_MIN_BYTES or more. config.json is written last, so a directory holding
    it is a complete checkpoint. Returns `out` as a Path.
    """
    if out is None:
        raise MakeModelError("out (the checkpoint directory) is required")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise MakeModelError(f"seed must be a non-negative integer, got {seed!r}")
    shard_size_bytes = parse_size(shard_size_bytes)
    config = build_config(arch, size, dtype, overrides)
    tokenizer_json, tokenizer_config = build_tokenizer(config)  # validates specials before writing
    out = Path(out)
    _prepare_out(out, force)
    if not config_only:
        _write_weights(out, config, seed, dtype, shard_size_bytes, progress)
    tmp = out / "tokenizer.json.tmp"
    tmp.write_text(tokenizer_json + "\n")
    os.replace(tmp, out / "tokenizer.json")
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", _generation_config(config))
    _write_json(out / "config.json", config)
    return out


# ----------------------------------------------------------------------------------------------
# CLI


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"value of {key} is not JSON: {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make_model.py", description="Build a Hugging Face checkpoint with random weights.")
    parser.add_argument("--arch", choices=ARCHS,
                        help="model family (default for a preset: the preset's family)")
    parser.add_argument("--size", required=True,
                        help=f"'tiny' or a preset: {', '.join(preset_names())}")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--shard-size", default="2GB",
                        help="largest safetensors file, e.g. 2GB, 500MB (default 2GB)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--config-only", action="store_true",
                        help="write config, generation config and tokenizer but no weights")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        type=_parse_override, metavar="KEY=JSON",
                        help="patch a config.json field, e.g. --set num_hidden_layers=2")
    args = parser.parse_args(argv)
    try:
        out = make_model(args.arch, args.size, args.dtype, args.seed, args.out,
                         parse_size(args.shard_size), dict(args.overrides), force=args.force,
                         config_only=args.config_only)
    except MakeModelError as e:
        parser.error(str(e))  # exits 2 with the usage line and the message
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
