"""config.json → ModelConfig: the four families, RoPE variants, and clear rejections."""
import json
from pathlib import Path

import pytest
import torch

from executor.errors import ConfigError
from executor.model_config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[2] / "tools" / "model_configs"


def write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def base(name="qwen3-0.6b", **changes):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_every_reference_config_loads(path):
    cfg = ModelConfig.from_dict(json.loads(path.read_text()))
    assert cfg.num_units == cfg.num_layers + 2
    assert cfg.num_heads % cfg.num_kv_heads == 0
    assert cfg.dtype == torch.bfloat16


def test_family_traits():
    assert ModelConfig.from_dict(base("qwen3-8b")).qk_norm
    q2 = ModelConfig.from_dict(base("qwen2.5-7b"))
    assert q2.attention_bias and not q2.qk_norm and q2.head_dim == 3584 // 28
    llama = ModelConfig.from_dict(base("llama-3.2-1b"))
    assert llama.rope.rope_type == "llama3" and llama.rope.factor == 32.0 and llama.tie_word_embeddings


def test_transformers5_rope_parameters_form():
    cfg = base("llama-3.2-1b")
    scaling = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.pop("rope_theta")}
    assert ModelConfig.from_dict(cfg).rope == ModelConfig.from_dict(base("llama-3.2-1b")).rope


def test_eos_from_generation_config(tmp_path):
    write(tmp_path, base())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("change,message", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "unsupported architecture"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
    (dict(sliding_window=4096, use_sliding_window=True, max_window_layers=0), "sliding-window"),
    (dict(sliding_window=4096, use_sliding_window=True, layer_types=["full_attention"] * 27 + ["sliding_attention"]),
     "sliding-window"),
    (dict(sliding_window=None, use_sliding_window=True, max_window_layers=0), "sliding_window=4096"),
    (dict(use_sliding_window=True, max_window_layers=None, num_hidden_layers=40), "sliding-window"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_key_value_heads=3), "multiple"),
    (dict(torch_dtype="int8"), "torch_dtype"),
    (dict(rope_scaling="yarn"), "must be objects"),
    (dict(rope_theta="abc"), "rope_theta must be a positive number"),
    (dict(num_key_value_heads="2"), "num_key_value_heads' must be a positive integer"),
    (dict(num_key_value_heads=-2), "num_key_value_heads' must be a positive integer"),
    (dict(head_dim="32"), "head_dim' must be a positive integer"),
])
def test_rejections_name_the_problem(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dir(write(tmp_path, base(**change)))


def test_mistral_window_is_every_layers_whatever_layer_types_says():
    with pytest.raises(ConfigError, match="sliding-window"):
        ModelConfig.from_dict(base("mistral-7b-v0.3", sliding_window=4096, layer_types=["full_attention"] * 32))


def test_mistral_window_is_rejected_only_when_used():
    assert ModelConfig.from_dict(base("mistral-7b-v0.3", sliding_window=None))
    assert ModelConfig.from_dict(base("mistral-7b-v0.3", sliding_window=32768))  # = context: never slides
    with pytest.raises(ConfigError, match="sliding-window"):
        ModelConfig.from_dict(base("mistral-7b-v0.3", sliding_window=4096))


def test_missing_field(tmp_path):
    cfg = base()
    del cfg["num_hidden_layers"]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelConfig.from_dir(write(tmp_path, cfg))


def test_missing_and_corrupt_config(tmp_path):
    with pytest.raises(ConfigError, match="model config not found: .*config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed model config .* at line 1 column 2"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_dir(tmp_path)


def test_dtype_is_read_as_transformers_5_reads_it(tmp_path):
    """`dtype` (transformers 5) before `torch_dtype` (4.x), as the planner reads them; with
    neither, the weights' own dtype (the planner, config-only, assumes bfloat16)."""
    cfg = base(torch_dtype="float32", dtype="bfloat16")
    assert ModelConfig.from_dir(write(tmp_path, cfg)).dtype == torch.bfloat16
    from tools.make_model import make_model

    from safetensors.torch import load_file, save_file

    out = make_model("qwen3", "tiny", "fp16", 0, tmp_path / "ckpt")
    raw = json.loads((out / "config.json").read_text())
    raw.pop("dtype", None), raw.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(out).dtype == torch.float16
    # norms kept in fp32 beside fp16 linears: safetensors writes the fp32 tensors first
    tensors = {n: t.float() if "norm" in n else t for n, t in load_file(out / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors")
    assert ModelConfig.from_dir(out).dtype == torch.float16


@pytest.mark.parametrize("change", [dict(sliding_window=4096, use_sliding_window=None),
                                    dict(sliding_window=4096, use_sliding_window=True, max_window_layers=28),
                                    dict(sliding_window=4096, use_sliding_window=True, max_window_layers=0,
                                         layer_types=["full_attention"] * 28)])
def test_a_qwen_window_that_no_layer_uses_is_full_attention(tmp_path, change):
    """As transformers reads a Qwen config: use_sliding_window off by default, and only the layers
    from max_window_layers on slide (Qwen3-0.6B has 28)."""
    cfg = base(**change)
    if cfg.get("use_sliding_window") is None:
        cfg.pop("use_sliding_window")
    assert ModelConfig.from_dir(write(tmp_path, cfg)).num_layers == 28


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b-v0.3"])
def test_keys_left_out_take_transformers_defaults(name):
    """A config.json without head_dim or sliding_window is read as transformers' config class reads
    it (Qwen3's head_dim defaults to 128, not hidden / heads; Mistral's window to 4096)."""
    from transformers import AutoConfig

    raw = base(name)
    raw.pop("head_dim", None)
    raw["hidden_size"] = raw["num_attention_heads"] * 96  # hidden / heads != 128
    reference = AutoConfig.for_model(**raw)
    expected = getattr(reference, "head_dim", None) or raw["hidden_size"] // raw["num_attention_heads"]
    assert ModelConfig.from_dict(raw).head_dim == expected
    raw.pop("sliding_window", None)
    window = getattr(AutoConfig.for_model(**raw), "sliding_window", None)
    if name.startswith("mistral"):  # every Mistral layer slides by its window (Qwen's need use_sliding_window)
        assert window is not None and window < raw["max_position_embeddings"]
        with pytest.raises(ConfigError, match=f"sliding_window={window}"):
            ModelConfig.from_dict(raw)
    else:
        assert ModelConfig.from_dict(raw).num_layers == raw["num_hidden_layers"]


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_an_o_proj_bias_is_refused_by_its_config_key(name):
    with pytest.raises(ConfigError, match="attention_bias=true is not supported"):
        ModelConfig.from_dict(base(name, attention_bias=True))


def test_mistral_has_no_attention_biases_whatever_the_config_says():
    """transformers builds Mistral's projections without biases, attention_bias or not."""
    assert not ModelConfig.from_dict(base("mistral-7b-v0.3", attention_bias=True)).attention_bias
