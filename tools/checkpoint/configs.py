"""config.json for a family and size: a real model's (tools/model_configs) or the tiny test size."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tools.checkpoint import DTYPES, MakeModelError

PRESET_DIR = Path(__file__).resolve().parent.parent / "model_configs"


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


def eos_ids(config: dict) -> list[int]:
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
    if head_dim(c) % 2:
        raise MakeModelError(f"head_dim {head_dim(c)} is odd: RoPE rotates pairs of dimensions")
    vocab = c["vocab_size"]
    for key, ids in (("bos_token_id", [c.get("bos_token_id")]), ("eos_token_id", eos_ids(c))):
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < vocab:
                raise MakeModelError(f"{key} {c.get(key)!r} does not fit vocab_size {vocab}; "
                                     f"override {key} too")
    rope = c.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise MakeModelError(f"rope_scaling must be an object or null, got {rope!r}")


def head_dim(c: dict) -> int:
    """As transformers reads it: Qwen3's config class defaults to 128, the others' to hidden / heads."""
    if c.get("head_dim"):
        return c["head_dim"]
    return 128 if c.get("model_type") == "qwen3" else c["hidden_size"] // c["num_attention_heads"]
