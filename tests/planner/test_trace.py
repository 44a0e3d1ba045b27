"""Trace → IR: per-unit numbers from the traced graph, checked against DESIGN.md's formulas."""
from __future__ import annotations

import json

import pytest

from planner.errors import PlanError
from planner.trace import TRACE_CONTEXT_TOKENS, reused_block, trace, trace_model
from tests.planner.conftest import CONFIG_NAMES, config_path


def _cfg(name: str) -> dict:
    return json.loads(config_path(name).read_text())


def _dims(c: dict) -> dict:
    H, ha = c["hidden_size"], c["num_attention_heads"]
    return dict(H=H, ha=ha, hkv=c.get("num_key_value_heads", ha), d=c.get("head_dim") or H // ha,
                I=c["intermediate_size"], V=c["vocab_size"], L=c["num_hidden_layers"],
                tied=bool(c.get("tie_word_embeddings")))


def _block_params_formula(c: dict) -> int:
    """DESIGN §3 per-block parameter count: attention + MLP + two norm vectors (+ family extras)."""
    k = _dims(c)
    H, qd, kvd = k["H"], k["ha"] * k["d"], k["hkv"] * k["d"]
    attn = H * qd + 2 * H * kvd + qd * H
    if c["model_type"] == "qwen2":          # q/k/v projections carry biases
        attn += qd + 2 * kvd
    if c["model_type"] == "qwen3":          # per-head RMSNorm on q and k
        attn += 2 * k["d"]
    return attn + 3 * H * k["I"] + 2 * H


def test_qwen3_8b_design_check_figures():
    ir = trace_model(config_path("qwen3-8b"))
    assert ir.num_units == 38 and ir.num_blocks == 36
    block = ir.units[1]
    assert block.kind == "block" and block.weights == ("model.layers.0",)
    # DESIGN §3: attention 41.9M params (83.9 MB), MLP 151.0M (302.0 MB), norms 16 KB: ≈386 MB
    assert block.weight_bytes == 2 * (41_943_296 + 150_994_944 + 8192)
    assert abs(block.read_bytes_per_token / 1e6 - 386) < 0.5
    assert block.act_bytes_per_token == 8 * 1024            # B·H·2 at batch 1
    assert block.kv_bytes_per_token == 4 * 1024             # 2·h_kv·d_h·2 per token per block
    assert 4096 * block.kv_bytes_per_token == 16 * 1024 ** 2  # 16 MiB per block at c = 4096
    H, dkv, I = 4096, 1024, 12288
    assert block.proj_flops_per_token == 2 * (2 * H * H + 2 * H * dkv + 3 * H * I)   # F_proj
    assert block.attn_flops_per_context_token == 4 * 32 * 128                        # F_attn / c


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_reference_config_traces_to_the_formulas(name):
    c = _cfg(name)
    k = _dims(c)
    ir = trace_model(config_path(name))
    assert ir.num_blocks == k["L"] and ir.num_units == k["L"] + 2
    assert [u.kind for u in ir.units] == ["embedding"] + ["block"] * k["L"] + ["head"]
    assert ir.unattributed_weight_bytes == 0
    emb, head = ir.units[0], ir.units[-1]
    assert emb.weight_bytes == 2 * k["V"] * k["H"]
    assert emb.read_bytes_per_token == 2 * k["H"]           # the embedding reads one row per token
    assert emb.act_bytes_per_token == 2 * k["H"]
    assert head.read_bytes_per_token == head.weight_bytes == 2 * (k["V"] * k["H"] + k["H"])
    assert head.act_bytes_per_token == 2 * k["V"]          # the logits
    assert head.proj_flops_per_token == 2 * k["V"] * k["H"]
    H, qd, kvd = k["H"], k["ha"] * k["d"], k["hkv"] * k["d"]
    for b in ir.units[1:-1]:
        assert b.weight_bytes == b.read_bytes_per_token == 2 * _block_params_formula(c)
        assert b.act_bytes_per_token == 2 * H
        assert b.kv_bytes_per_token == 2 * kvd * 2
        assert b.proj_flops_per_token == 2 * (2 * H * qd + 2 * H * kvd + 3 * H * k["I"])
        assert b.attn_flops_per_context_token == 4 * k["ha"] * k["d"]
    if k["tied"]:
        assert [(s.name, s.units) for s in ir.shared_weights] == [("model.embed_tokens.weight", (0, k["L"] + 1))]
        assert "model.embed_tokens" in head.weights
    else:
        assert ir.shared_weights == () and head.weights == ("lm_head", "model.norm")


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_unit_bytes_equal_the_parameters_of_the_model_built_from_the_config(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = _cfg(name)
    cfg = AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    ir = trace_model(config_path(name))
    shared = sum((len(s.units) - 1) * s.weight_bytes for s in ir.shared_weights)
    assert sum(u.weight_bytes for u in ir.units) - shared == 2 * params == ir.weight_bytes
    assert ir.num_params == params


@pytest.mark.parametrize("name,layers", [("qwen3-0.6b", 4), ("llama-3.2-1b", 16)])
def test_reusing_identical_blocks_gives_the_same_ir_as_tracing_every_block(name, layers):
    cfg = {**_cfg(name), "num_hidden_layers": layers}
    fast = trace_model(cfg)
    full = trace_model(cfg, dedupe=False)
    assert all(u.traced_as == u.index for u in full.units)
    assert {u.traced_as for u in fast.units[1:-1]} == {1}
    strip = lambda ir: [u.__class__(**{**u.__dict__, "traced_as": 0}) for u in ir.units]  # noqa: E731
    assert strip(fast) == strip(full)
    assert fast.shared_weights == full.shared_weights and fast.weight_bytes == full.weight_bytes


def test_graph_nodes_carry_shape_dtype_flops_and_unit():
    r = trace(config_path("qwen3-0.6b"))
    ops = [n for n in r.decode_graph.nodes if n.op == "call_function"]
    assert ops
    for n in ops:
        assert {"shape", "dtype", "flops", "unit", "bytes", "param_bytes"} <= set(n.meta), n
    # the first block is traced op by op; the others reuse it
    assert sum(1 for n in ops if n.target is reused_block) == r.ir.num_blocks - 1
    mm = [n for n in ops if n.meta["unit"] == 1 and n.meta["weight_op"]]
    assert sum(n.meta["flops"] for n in mm) == r.ir.units[1].proj_flops_per_token
    assert all(n.meta["param_bytes"] > 0 for n in mm)
    emb = next(n for n in ops if "embedding" in str(n.target))
    assert emb.meta["unit"] == 0 and emb.meta["shape"] == (1, 1, 1024) and emb.meta["dtype"] == "bfloat16"


def test_prefill_graph_agrees_with_the_decode_coefficients():
    r = trace(config_path("qwen3-0.6b"))
    S, u = TRACE_CONTEXT_TOKENS, r.ir.units[1]
    ops = [n for n in r.prefill_graph.nodes if n.op == "call_function" and n.meta["unit"] == 1]
    weight = sum(n.meta["flops"] for n in ops if n.meta["weight_op"])
    act = sum(n.meta["flops"] for n in ops if not n.meta["weight_op"])
    assert weight == S * u.proj_flops_per_token
    assert act == S * S * u.attn_flops_per_context_token   # SDPA's math path scores the full S×S
    assert u.prefill_flops(S) == S * u.proj_flops_per_token + u.attn_flops_per_context_token * S * (S + 1) // 2


@pytest.mark.parametrize("model_type,extra", [
    ("phi3", {"pad_token_id": 0}), ("olmo2", {}), ("granite", {}),
])
def test_architectures_outside_the_reference_set_trace_without_family_code(model_type, extra):
    c = dict(model_type=model_type, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=3, vocab_size=256, head_dim=16,
             bos_token_id=1, eos_token_id=2, **extra)
    ir = trace_model(c, "float32")
    assert ir.num_units == 5 and ir.unattributed_weight_bytes == 0
    b = ir.units[1]
    assert b.act_bytes_per_token == 64 * 4 and b.kv_bytes_per_token == 2 * 2 * 16 * 4
    assert b.attn_flops_per_context_token == 4 * 4 * 16
    assert sum(u.weight_bytes for u in ir.units) - sum(
        (len(s.units) - 1) * s.weight_bytes for s in ir.shared_weights) == ir.weight_bytes


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(PlanError, match="unknown architecture: model_type 'no-such-arch'"):
        trace_model({"model_type": "no-such-arch", "hidden_size": 8})
    with pytest.raises(PlanError, match="not a causal LM"):
        trace_model({"model_type": "t5", "architectures": ["T5Model"]})


def test_a_decode_step_that_reads_no_kv_cache_is_an_error_not_a_plan_without_kv(monkeypatch):
    """The cache goes back under the name the model returned it by (transformers renamed it); a
    forward that swallows an unknown keyword (**kwargs) would run the step without it, and the plan
    would price no KV: that must fail loudly."""
    import planner.trace as trace_module

    returned = trace_module._returned_cache
    monkeypatch.setattr(trace_module, "_returned_cache", lambda out: ("no_such_cache", returned(out)[1]))
    config = json.loads(config_path("qwen3-8b").read_text())
    config["num_hidden_layers"] = 3  # a config no other test traces: traces are cached per config
    with pytest.raises(PlanError, match="decode step read no KV cache"):
        trace_model(config)


def test_malformed_configs_are_clear_errors(tmp_path):
    with pytest.raises(PlanError, match="no 'model_type'"):
        trace_model({"hidden_size": 8})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="malformed model config .*line 1"):
        trace_model(tmp_path)
    bad.write_text("[1, 2]")
    with pytest.raises(PlanError, match="expected a JSON object"):
        trace_model(bad)
    with pytest.raises(PlanError, match="not found"):
        trace_model(tmp_path / "missing")
    with pytest.raises(PlanError):
        trace_model({"model_type": "qwen3", "hidden_size": "wide", "num_hidden_layers": 2})
