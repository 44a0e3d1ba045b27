"""Hugging Face checkpoints with real architectures and random weights, because nothing can be
downloaded from a model hub (DESIGN.md §9); tools/make_model.py is the command.

    configs.py      presets (tools/model_configs) and the tiny sizes, per family: config.json
    weights.py      every tensor a config implies, drawn reproducibly (the initialisation)
    shards.py       safetensors shards written one chunk at a time, never a whole model in memory
    tokenizer.py    a byte-level BPE tokenizer trained on a generated corpus, per family
"""
from __future__ import annotations

import torch

# --dtype name -> (torch dtype, config.json torch_dtype, safetensors dtype tag)
DTYPES: dict[str, tuple[torch.dtype, str, str]] = {
    "bf16": (torch.bfloat16, "bfloat16", "BF16"),
    "fp16": (torch.float16, "float16", "F16"),
    "fp32": (torch.float32, "float32", "F32"),
}


class MakeModelError(ValueError):
    """A bad request (unknown arch/size/dtype, inconsistent overrides, occupied --out ...)."""
