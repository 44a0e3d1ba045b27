"""tools/make_model.py: tiny checkpoints of all four families load in transformers exactly as real ones
do, decode varied text greedily, are byte-for-byte deterministic, shard, store each dtype, and the real
presets keep their config.json fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tools import make_model as mm
from tools.checkpoint import configs, shards, weights
from tools.make_model import MakeModelError, make_model

ARCHS = ("qwen3", "llama", "qwen2", "mistral")
REPO = Path(__file__).resolve().parents[2]
TEXT = ("The river town woke slowly; at 7:45 the ferry bell rang, twice.\n"
        "  def add(a, b):\n\treturn a + b  # naïve café, 12345 apples 😀")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These models are tiny: one thread is faster, and much faster on a shared, busy machine
    (OpenMP threads spinning against other processes made generation 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load(path: Path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _prompts(n: int, vocab_limit: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(10, vocab_limit, (n, 20), generator=gen)  # [n, 20], no special ids


def _shortest_period(tokens: list[int], max_period: int = 4) -> int | None:
    tail = tokens[-16:]
    for p in range(1, max_period + 1):
        if all(tail[i] == tail[i - p] for i in range(p, len(tail))):
            return p
    return None


# ----------------------------------------------------------------------------------------------
# Tiny models in transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_loads_in_transformers_with_exact_names(checkpoint, arch):
    path = checkpoint(arch)
    cfg = _config(path)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                       output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert type(model).__name__ == cfg["architectures"][0]
    names = set(_tensors(path))
    expected = set(model.state_dict())
    if cfg["tie_word_embeddings"]:
        expected.discard("lm_head.weight")
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert names == expected == {s.name for s in weights.tensor_specs(cfg)}
    # transformers reads the legacy rope_theta / rope_scaling fields the files carry.
    assert model.config.rope_parameters["rope_theta"] == cfg["rope_theta"]
    if arch == "llama":
        assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.vocab_size == cfg["vocab_size"]


def test_tiny_family_features(checkpoint):
    qwen3, llama, qwen2, mistral = (_config(checkpoint(a)) for a in ARCHS)
    assert qwen3["tie_word_embeddings"] and llama["tie_word_embeddings"]
    assert not qwen2["tie_word_embeddings"] and not mistral["tie_word_embeddings"]
    assert qwen3["head_dim"] * qwen3["num_attention_heads"] != qwen3["hidden_size"]
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert mistral["sliding_window"] is None
    assert qwen2["use_sliding_window"] is False
    names = {a: set(_tensors(checkpoint(a))) for a in ARCHS}
    assert "model.layers.0.self_attn.q_norm.weight" in names["qwen3"]
    assert "model.layers.0.self_attn.k_proj.bias" in names["qwen2"]
    assert "model.layers.0.self_attn.o_proj.bias" not in names["qwen2"]
    assert not any(n.endswith(".bias") for a in ("qwen3", "llama", "mistral") for n in names[a])
    assert "lm_head.weight" in names["mistral"] and "lm_head.weight" not in names["qwen3"]
    for cfg in (qwen3, llama, qwen2, mistral):
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
                cfg["num_key_value_heads"], cfg["vocab_size"]) == (4, 64, 4, 2, 1024)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_greedy_decoding_is_not_degenerate(checkpoint, arch):
    path = checkpoint(arch)
    model = _load(path)
    prompts = _prompts(3, 900)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             attention_mask=torch.ones_like(prompts))
    for row in out[:, 20:].tolist():
        assert len(set(row)) >= 8, row
        assert _shortest_period(row) is None, row


def test_real_dims_cut_down_is_not_degenerate(tmp_path):
    # Qwen3-0.6B widths (hidden 1024, 16 x 128 query heads, MLP 3072), 2 blocks, smaller vocab.
    path = make_model("qwen3", "qwen3-0.6b", "fp32", 0, tmp_path, overrides={
        "num_hidden_layers": 2, "vocab_size": 4096, "bos_token_id": 4000, "eos_token_id": 4002})
    model = _load(path)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (2048, 1024)
    prompts = _prompts(2, 3900)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             attention_mask=torch.ones_like(prompts))
        logits = model(prompts).logits  # [2, 20, V]
    assert 2.0 < logits.std().item() < 4.5  # LOGIT_STD = 3
    for row in out[:, 20:].tolist():
        assert len(set(row)) >= 8, row


# ----------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_every_id_decodes_and_specials_sit_at_config_ids(checkpoint, arch):
    path = checkpoint(arch)
    cfg = _config(path)
    vocab = cfg["vocab_size"]
    auto = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert len(auto) == raw.get_vocab_size() == vocab
    assert all(auto.decode([i]) for i in range(vocab))
    assert all(raw.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False))

    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    assert auto.bos_token_id == cfg["bos_token_id"] and auto.eos_token_id == eos[0]
    special = {i for i, t in auto.added_tokens_decoder.items() if t.special}
    assert {cfg["bos_token_id"], *eos} <= special
    expected = {"qwen3": ("<|endoftext|>", "<|im_end|>"), "qwen2": ("<|endoftext|>", "<|im_end|>"),
                "llama": ("<|begin_of_text|>", "<|end_of_text|>"), "mistral": ("<s>", "</s>")}[arch]
    assert (raw.id_to_token(cfg["bos_token_id"]), raw.id_to_token(eos[0])) == expected
    assert raw.token_to_id(expected[1]) == eos[0]

    ids = auto(TEXT)["input_ids"]
    assert ids == raw.encode(TEXT).ids
    assert (ids[0] == cfg["bos_token_id"]) == (arch in ("llama", "mistral"))
    assert cfg["bos_token_id"] not in ids[1:]
    assert auto.decode(ids, skip_special_tokens=True) == TEXT
    english = "The old teacher carefully answered the question near the quiet river."
    assert len(raw.encode(english).ids) < len(english) // 3  # the trained merges compress text
    assert auto(expected[1], add_special_tokens=False)["input_ids"] == [eos[0]]


def test_real_preset_tokenizer_and_config_only(tmp_path):
    path = make_model(None, "qwen3-0.6b", "bf16", 0, tmp_path, config_only=True)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert _config(path) == json.loads((configs.PRESET_DIR / "qwen3-0.6b.json").read_text())
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert raw.get_vocab_size() == 151936
    assert [raw.id_to_token(i) for i in (151643, 151644, 151645)] == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert all(raw.decode_batch([[i] for i in range(151936)], skip_special_tokens=False))
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == 151643


# ----------------------------------------------------------------------------------------------
# Determinism, sharding, dtypes


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_arguments_give_byte_identical_files_cli_and_api(tmp_path):
    cli_out = tmp_path / "cli"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_model.py"), "--arch", "qwen2",
                    "--size", "tiny", "--dtype", "bf16", "--seed", "3", "--out", str(cli_out)],
                   check=True, capture_output=True, cwd=tmp_path)
    api_out = make_model("qwen2", "tiny", "bf16", 3, tmp_path / "api")
    assert _file_bytes(cli_out) == _file_bytes(api_out)

    other = make_model("qwen2", "tiny", "bf16", 4, tmp_path / "other")
    a, b = _tensors(api_out), _tensors(other)
    assert a.keys() == b.keys()
    assert not any(torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (api_out / name).read_bytes() == (other / name).read_bytes()


def test_tensor_values_do_not_depend_on_dtype_or_other_tensors(checkpoint):
    fp32, bf16 = _tensors(checkpoint("llama", "fp32")), _tensors(checkpoint("llama", "bf16"))
    for name, value in fp32.items():
        assert torch.equal(value.to(torch.bfloat16), bf16[name]), name
    one_layer = _tensors(checkpoint("llama", "fp32", num_hidden_layers=1))
    assert torch.equal(one_layer["model.layers.0.mlp.up_proj.weight"],
                       fp32["model.layers.0.mlp.up_proj.weight"])
    spec = weights.tensor_specs(_config(checkpoint("llama")))[1]
    assert torch.equal(weights.materialize(spec, 0, "fp32"), fp32[spec.name])


def test_init_scales(checkpoint):
    cfg = _config(checkpoint("qwen3"))
    t = _tensors(checkpoint("qwen3"))
    q = t["model.layers.1.self_attn.q_proj.weight"]
    assert abs(q.std().item() - weights.QK_GAIN / 64**0.5) < 0.02
    down = t["model.layers.1.mlp.down_proj.weight"]
    assert abs(down.std().item() - 1 / cfg["intermediate_size"] ** 0.5) < 0.01
    qn = t["model.layers.0.self_attn.q_norm.weight"]
    assert abs(qn.mean().item() - weights.QK_GAIN) < 0.1 and qn.std().item() > 0.05
    ln = t["model.layers.0.input_layernorm.weight"]
    assert 0.9 < ln.mean().item() < 1.1 and 0.05 < ln.std().item() < 0.15
    assert abs(t["model.norm.weight"].mean().item() - 3.0) < 0.2


@pytest.mark.parametrize("dtype,torch_dtype,name", [
    ("bf16", torch.bfloat16, "bfloat16"), ("fp16", torch.float16, "float16"),
    ("fp32", torch.float32, "float32")])
def test_dtype_is_stored_as_asked(checkpoint, dtype, torch_dtype, name):
    path = checkpoint("mistral", dtype)
    assert _config(path)["torch_dtype"] == name
    tensors = _tensors(path)
    assert {t.dtype for t in tensors.values()} == {torch_dtype}
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == torch_dtype


def test_sharded_checkpoint_loads_with_identical_logits(checkpoint, tmp_path):
    whole = checkpoint("qwen3")
    shard_size = 100_000
    sharded = make_model("qwen3", "tiny", "fp32", 0, tmp_path, shard_size_bytes=shard_size)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    tensors = _tensors(sharded)
    assert index["weight_map"].keys() == tensors.keys() == _tensors(whole).keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    for f in files:
        with safe_open(sharded / f, "pt") as st:
            sizes = [st.get_slice(k).get_shape() for k in st.keys()]
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= shard_size or len(sizes) == 1
    ids = _prompts(1, 900)
    with torch.no_grad():
        assert torch.equal(_load(whole)(ids).logits, _load(sharded)(ids).logits)


def test_shards_written_at_once_are_the_bytes_written_one_by_one(tmp_path):
    """A sharded checkpoint's shards are written by several processes at once by default; the
    files are the same bytes as one process writes."""
    one = make_model("llama", "tiny", "bf16", 5, tmp_path / "one", shard_size_bytes=60_000, jobs=1)
    three = make_model("llama", "tiny", "bf16", 5, tmp_path / "three", shard_size_bytes=60_000, jobs=3)
    assert len(list(one.glob("model-*.safetensors"))) > 3
    assert _file_bytes(one) == _file_bytes(three)


def test_a_shard_that_cannot_be_written_fails_the_checkpoint_and_leaves_no_partial_file(tmp_path):
    config = configs.build_config("llama", "tiny", "bf16", None)
    count = len(shards._plan_shards(weights.tensor_specs(config), 2, 60_000))
    blocker = tmp_path / f"model-00002-of-{count:05d}.safetensors.tmp"
    blocker.mkdir()  # where shard 2's writer must open its file
    with pytest.raises(MakeModelError, match=f"shard 2/{count}"):
        shards.write_weights(tmp_path, config, 0, "bf16", 60_000, progress=False, jobs=3)
    assert [p.name for p in tmp_path.glob("*.tmp")] == [blocker.name]
    assert not (tmp_path / "model.safetensors.index.json").exists()


# ----------------------------------------------------------------------------------------------
# Configs, overrides, errors


@pytest.mark.parametrize("preset", configs.preset_names())
def test_real_preset_config_equals_reference(preset):
    reference = json.loads((configs.PRESET_DIR / f"{preset}.json").read_text())
    assert configs.build_config(None, preset, "bf16") == reference
    assert configs.build_config(reference["model_type"], preset, "fp16")["torch_dtype"] == "float16"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_config_has_the_real_field_set(arch):
    reference = json.loads((configs.PRESET_DIR / f"{configs.FAMILIES[arch].reference}.json").read_text())
    assert configs.build_config(arch, "tiny", "fp32").keys() == reference.keys()


def test_overrides_patch_config_and_tensors(tmp_path):
    path = make_model("qwen3", "tiny", "fp32", 0, tmp_path, overrides={
        "num_hidden_layers": 1, "tie_word_embeddings": False, "attention_bias": True,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    cfg = _config(path)
    assert cfg["num_hidden_layers"] == 1 and cfg["rope_scaling"]["rope_type"] == "linear"
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    names = set(_tensors(path))
    assert "lm_head.weight" in names and "model.layers.0.self_attn.o_proj.bias" in names
    assert not any(n.startswith("model.layers.1.") for n in names)


def test_force_replaces_an_earlier_build(tmp_path):
    make_model("llama", "tiny", "fp32", 0, tmp_path, shard_size_bytes=100_000)
    with pytest.raises(MakeModelError, match="not empty.*--force"):
        make_model("llama", "tiny", "fp32", 1, tmp_path)
    (tmp_path / "notes.txt").write_text("keep me")
    make_model("llama", "tiny", "fp16", 1, tmp_path, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "notes.txt",
        "tokenizer.json", "tokenizer_config.json"]


def test_progress_goes_to_stderr(tmp_path, capsys):
    make_model("mistral", "tiny", "bf16", 0, tmp_path, progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "make_model:" in captured.err and "100%" in captured.err


@pytest.mark.parametrize("kwargs,message", [
    (dict(arch="gpt2", size="tiny"), "unknown arch 'gpt2'"),
    (dict(arch="qwen3", size="huge"), "unknown size 'huge'.*qwen3-1.7b"),
    (dict(arch=None, size="tiny"), "needs an arch"),
    (dict(arch="llama", size="qwen3-1.7b"), "'qwen3-1.7b' is a qwen3 model.*--arch qwen3"),
    (dict(arch="qwen3", size="tiny", dtype="int8"), "unknown dtype 'int8'"),
    (dict(arch="qwen3", size="tiny", seed=-1), "seed must be a non-negative integer"),
    (dict(arch="qwen3", size="tiny", overrides={"num_layers": 2}), r"unknown qwen3 config field"),
    (dict(arch="qwen3", size="tiny", overrides={"model_type": "llama"}), "cannot override"),
    (dict(arch="qwen3", size="tiny", overrides={"num_key_value_heads": 3}), "not a multiple"),
    (dict(arch="qwen3", size="tiny", overrides={"hidden_size": 0}), "hidden_size must be"),
    (dict(arch="qwen3", size="qwen3-0.6b", overrides={"vocab_size": 1000}),
     "bos_token_id 151643 does not fit vocab_size 1000"),
    (dict(arch="qwen3", size="tiny", overrides={"eos_token_id": 5}), "not where the qwen3 layout"),
    (dict(arch="mistral", size="tiny", overrides={"vocab_size": 200}), "needs at least 256"),
    (dict(arch="llama", size="tiny", overrides={"head_dim": 15}), "head_dim 15 is odd"),
    (dict(arch="qwen3", size="tiny", shard_size_bytes="2 parsecs"), "bad size"),
    (dict(arch="qwen3", size="tiny", out=None), "out .* is required"),
])
def test_bad_arguments_give_clear_errors(tmp_path, kwargs, message):
    kwargs.setdefault("out", tmp_path / "out")
    with pytest.raises(MakeModelError, match=message):
        make_model(**kwargs)
    assert not (tmp_path / "out").exists()  # nothing written for a rejected request


def test_cli_errors_exit_2_with_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        mm.main(["--arch", "llama", "--size", "mistral-7b-v0.3", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert "is a mistral model" in capsys.readouterr().err


def test_cli_arch_defaults_to_preset_family_and_set_overrides(tmp_path, capsys):
    out = tmp_path / "m"
    assert mm.main(["--size", "mistral-7b-v0.3", "--config-only", "--out", str(out),
                    "--set", "num_hidden_layers=2", "--set", "rope_theta=10000.0"]) == 0
    cfg = _config(out)
    assert cfg["model_type"] == "mistral" and cfg["num_hidden_layers"] == 2
    assert cfg["rope_theta"] == 10000.0 and cfg["torch_dtype"] == "bfloat16"


def test_parse_size():
    assert shards.parse_size("2GB") == 2 * 10**9
    assert shards.parse_size("500MiB") == 500 * 2**20
    assert shards.parse_size("1.5 kb") == 1500
    assert shards.parse_size(123) == 123
    with pytest.raises(MakeModelError):
        shards.parse_size("0")


def test_an_unwritable_out_is_a_clear_error(tmp_path, capsys):
    from tools.make_model import main

    blocker = tmp_path / "a file"
    blocker.write_text("")
    assert main(["--size", "tiny", "--arch", "qwen3", "--out", str(blocker / "model")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "Traceback" not in err
