"""Model configs: read a config.json (or a checkpoint directory), fingerprint it, build the model.

`config_digest` is the one function that fingerprints a model config; the executor uses it to
check that the weights on disk belong to the model a plan was made for. The model is built on
the `meta` device (no memory, no weights): config.json is all the planner needs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from planner.errors import PlanError

# Config fields that do not change the network a checkpoint holds: tokenizer ids, runtime and
# training switches, bookkeeping. Everything else (shapes, activation, norms, rope, tying, layer
# types, ...) is architecture and goes into the digest. The dtype is recorded separately in the
# plan (`model.dtype`), so a bf16 and an fp16 copy of the same model share a config digest.
_NOT_ARCHITECTURE = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype",
    "architectures_version", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "initializer_range",
    "attention_dropout", "hidden_dropout", "dropout", "embd_pdrop", "resid_pdrop",
    "chunk_size_feed_forward", "tokenizer_class", "torchscript", "_attn_implementation",
    "attn_implementation", "_attn_implementation_autoset", "tf_legacy_loss",
    "use_bfloat16", "pruned_heads", "task_specific_params", "finetuning_task", "prefix",
    "auto_map",
})

DTYPES = ("bfloat16", "float16", "float32")


def read_config(model: str | Path | dict) -> tuple[dict, str]:
    """Return (config dict, source) for a config.json path, a checkpoint directory or a dict."""
    if isinstance(model, dict):
        return dict(model), "<dict>"
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"model config not found: {path} (give a checkpoint directory or a config.json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read model config {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"malformed model config {path}: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise PlanError(f"malformed model config {path}: expected a JSON object, got {type(data).__name__}")
    return data, str(model)


def hf_config(data: dict):
    """The transformers config object for a config dict; PlanError for unknown architectures."""
    from transformers import AutoConfig

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PlanError("malformed model config: it has no 'model_type' (e.g. \"qwen3\", \"llama\")")
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError) as e:
        import transformers

        if "Unrecognized" in str(e) or isinstance(e, KeyError):
            raise PlanError(
                f"unknown architecture: model_type {model_type!r} is not known to transformers "
                f"{transformers.__version__}") from None
        raise PlanError(f"malformed model config ({model_type}): {e}") from None
    except Exception as e:  # noqa: BLE001 — transformers' validation errors have no common base
        msg = " ".join(str(e).split())
        raise PlanError(f"malformed model config ({model_type}): {msg}") from None


def normalized_config(data: dict) -> dict:
    """Architecture-relevant fields of a config, as transformers normalizes them (so a config
    re-saved by another transformers version, e.g. rope_theta vs rope_parameters, matches)."""
    try:
        full = hf_config(data).to_dict()
    except PlanError:
        full = dict(data)  # unknown to this transformers: fingerprint what the file says
    return {k: v for k, v in full.items() if k not in _NOT_ARCHITECTURE}


def config_digest(config: dict | str | Path) -> str:
    """sha256 of the canonical JSON of the config's architecture fields: 'sha256:<64 hex>'."""
    data = config if isinstance(config, dict) else read_config(config)[0]
    canon = json.dumps(normalized_config(data), sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


def config_dtype(data: dict, override: str | None = None) -> str:
    """The weight dtype: the override, else the config's dtype/torch_dtype, else bfloat16."""
    dtype = override or data.get("dtype") or data.get("torch_dtype") or "bfloat16"
    dtype = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
             "float": "float32"}.get(str(dtype), str(dtype))
    if dtype not in DTYPES:
        raise PlanError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return dtype


def architecture_name(data: dict) -> str:
    archs = data.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return f"{data.get('model_type', 'unknown')}ForCausalLM"


def build_meta_model(data: dict, dtype: str) -> Any:
    """The Hugging Face causal LM for this config on the meta device, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(data)
    try:
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(
                    cfg, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
            with torch.device("meta"):  # architectures without SDPA support: plain attention
                model = AutoModelForCausalLM.from_config(
                    cfg, dtype=getattr(torch, dtype), attn_implementation="eager")
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise PlanError(f"unknown architecture: {architecture_name(data)} "
                            f"(model_type {data.get('model_type')!r}) is not a causal LM in transformers") from None
        raise PlanError(f"cannot build {architecture_name(data)} from its config: {e}") from None
    except Exception as e:  # noqa: BLE001 — any failure here is a bad config, reported as such
        raise PlanError(f"cannot build {architecture_name(data)} from its config: "
                        f"{type(e).__name__}: {e}") from None
    return model.eval()
