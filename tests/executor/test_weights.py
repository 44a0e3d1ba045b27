"""What the loader takes from a checkpoint: every tensor it holds is used or refused, and a
damaged file is a clear error, against checkpoints from tools/make_model.py edited by hand."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.errors import WeightsError
from executor.loader import load_model
from executor.model_config import ModelConfig
from executor.placement import Placement
from executor.weights import CheckpointReader


def copy_of(checkpoint, tmp_path, arch="llama", **overrides):
    out = tmp_path / "ckpt"
    shutil.copytree(checkpoint(arch, "fp32", **overrides), out)
    return out


def load(path):
    cfg = ModelConfig.from_dir(path)
    return load_model(path, Placement.from_split(cfg.num_units, cfg.num_units, page_size_tokens=16), cfg,
                      backend="torch")


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_a_tensor_the_config_does_not_use_is_refused(checkpoint, tmp_path):
    """An o_proj bias (which a Llama with attention_bias has, and HELM's blocks do not add) left
    unread: the tokens would have been wrong."""
    path = copy_of(checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.ones(tensors["model.norm.weight"].shape)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="tensors this config does not use: model.layers.0.self_attn.o_proj.bias"):
        load(path)


def test_a_tied_head_is_used_only_where_it_is_the_embeddings_copy(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path, tie_word_embeddings=False)
    edit_config(path, tie_word_embeddings=True)
    with pytest.raises(WeightsError, match="lm_head.weight differs from it"):
        load(path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert load(path).stages[-1].head is not None  # a stored copy of the embedding: loads


def test_tensors_whose_data_overlap_are_refused(checkpoint, tmp_path):
    """A damaged header pointing two tensors at the same bytes (the safetensors library refuses
    it; read as it was, one layer took another's weights)."""
    path = copy_of(checkpoint, tmp_path)
    raw = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    (path / "model.safetensors").write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(WeightsError, match="overlapping or missing bytes"):
        CheckpointReader(path).names()


@pytest.mark.parametrize("weight_map", [[], None, {"model.norm.weight": 3}, {"model.norm.weight": "../x.safetensors"}])
def test_a_malformed_index_is_a_weights_error(checkpoint, tmp_path, weight_map):
    path = copy_of(checkpoint, tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError, match="not a valid safetensors index"):
        CheckpointReader(path)
