"""Typed model configuration read from a Hugging Face config.json.

`ModelConfig.from_dir` accepts the four decoder families HELM runs (Qwen3, Llama, Qwen2, Mistral)
and rejects, with a message naming the field, anything the executor would compute wrongly:
unknown RoPE types, sliding-window attention that the model actually uses, other activations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor.errors import ConfigError
from planner.config import read_config
from planner.errors import PlanError

# model_type -> family traits the executor needs beyond the common decoder layout, and the values
# transformers' config class gives a key config.json leaves out (a head_dim of None: hidden_size /
# num_attention_heads). Which projections carry biases: Qwen2 q/k/v always; Llama and Qwen3 q/k/v
# and o with attention_bias; Mistral none.
FAMILIES = {
    "qwen3": {"qk_norm": True, "head_dim": 128, "bias": "attention_bias"},
    "llama": {"qk_norm": False, "head_dim": None, "bias": "attention_bias"},
    "qwen2": {"qk_norm": False, "head_dim": None, "bias": "always"},
    "mistral": {"qk_norm": False, "head_dim": None, "bias": None, "sliding_window": 4096},
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" | "llama3"
    # llama3 scaling parameters (unused for "default")
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    dtype: torch.dtype  # weight dtype on disk
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_units(self) -> int:
        """Partition units: embedding, one per block, final norm + output projection."""
        return self.num_layers + 2

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw, _ = read_config(path)   # the one reader of config.json (planner.config)
        except PlanError as e:
            raise ConfigError(str(e)) from None
        eos = _read_eos(path.parent, raw)
        if not (raw.get("dtype") or raw.get("torch_dtype")):  # as transformers: the weights' own dtype
            raw = {**raw, "dtype": _checkpoint_dtype(path.parent)}
        return cls.from_dict(raw, source=str(path), eos_token_ids=eos)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config", eos_token_ids=None) -> "ModelConfig":
        def need(key, kind=int):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: missing required field '{key}'")
            value = raw[key]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"{source}: field '{key}' must be a positive number, got {value!r}")
            return value

        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(
                f"{source}: unsupported architecture model_type={model_type!r} "
                f"(architectures={raw.get('architectures')}); HELM runs {sorted(FAMILIES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (SwiGLU with silu only)")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        if FAMILIES[model_type]["bias"] == "attention_bias" and raw.get("attention_bias"):
            raise ConfigError(f"{source}: attention_bias=true is not supported for {model_type} (its o_proj "
                              "carries a bias too; HELM's blocks add biases to q/k/v only, as Qwen2's)")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = need("num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
        family = FAMILIES[model_type]
        head_dim = need("head_dim") if raw.get("head_dim") is not None else family["head_dim"] or hidden // heads
        if heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        max_pos = need("max_position_embeddings")
        _check_sliding_window(raw, source, max_pos)

        # transformers 5 writes `dtype` (and prefers it); 4.x wrote `torch_dtype`. The planner reads
        # them in the same order (planner.config.config_dtype); from_dir fills in the weights' own.
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ConfigError(f"{source}: torch_dtype={dtype_name!r} is not supported ({sorted(DTYPES)})")
        if eos_token_ids is None:
            eos_token_ids = _as_ids(raw.get("eos_token_id"))
        return cls(
            model_type=model_type,
            architecture=(raw.get("architectures") or [model_type])[0],
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            rms_norm_eps=need("rms_norm_eps", float),
            max_position_embeddings=max_pos,
            rope=_read_rope(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family["bias"] == "always",  # q/k/v (refused above where o_proj has one)
            qk_norm=family["qk_norm"],
            dtype=DTYPES[dtype_name],
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos_token_ids),
            raw=raw,
        )


def _checkpoint_dtype(model_dir: Path) -> str:
    """The dtype of the checkpoint's floating-point weights (a config that names none), from its
    first shard's header; float32 where that cannot be read (loading then says why)."""
    from executor.weights import floating_dtype_of

    try:
        dtype = floating_dtype_of(model_dir)
    except Exception:  # noqa: BLE001 — no readable weights: the loader names the problem
        return "float32"
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def _read_rope(raw: dict, source: str) -> RopeConfig:
    # transformers 4.x checkpoints carry rope_theta + rope_scaling; 5.x writes rope_parameters.
    params, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope_parameters and rope_scaling must be objects")
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "llama3":
        try:
            return RopeConfig(
                theta=float(theta),
                rope_type="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: llama3 rope_scaling is missing {e.args[0]!r}") from None
    raise ConfigError(f"{source}: rope_type={rope_type!r} is not supported (default, llama3)")


QWEN_MAX_WINDOW_LAYERS = 28  # transformers' defaults for Qwen2/Qwen3 configs
QWEN_SLIDING_WINDOW = 4096


def _check_sliding_window(raw: dict, source: str, max_pos: int) -> None:
    family = FAMILIES[raw.get("model_type")]
    window = raw["sliding_window"] if "sliding_window" in raw else family.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3"):
        # as transformers reads them: a window only with use_sliding_window (default off), on
        # the layers layer_types names or else those from max_window_layers on
        if not raw.get("use_sliding_window", False):
            return
        window = QWEN_SLIDING_WINDOW if window is None else window
        layer_types = raw.get("layer_types")
        if isinstance(layer_types, list):
            if "sliding_attention" not in layer_types:
                return
        else:
            first = raw.get("max_window_layers")
            first = QWEN_MAX_WINDOW_LAYERS if first is None else first
            if isinstance(first, bool) or not isinstance(first, int):
                raise ConfigError(f"{source}: max_window_layers must be an integer, got {first!r}")
            if first >= (raw.get("num_hidden_layers") or 0):
                return
    if window is None:
        return
    if not isinstance(window, int) or window < max_pos:
        raise ConfigError(
            f"{source}: sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_pos}) is not supported; HELM computes full attention"
        )


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_eos(model_dir: Path, raw: dict) -> list[int]:
    """EOS ids: generation_config.json wins (as in transformers), else config.json."""
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            ids = _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError, TypeError):
            ids = []
        if ids:
            return ids
    return _as_ids(raw.get("eos_token_id"))
