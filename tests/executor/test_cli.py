"""helm-executor generate: output contract and clear errors (exit 2, a message, no traceback)."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.cli import main
from tests.executor.helpers import helm_generate, prompt_ids


def run(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_matches_engine(checkpoint, capsys):
    path = checkpoint("qwen3", "fp32")
    prompt = prompt_ids(12, 256, seed=8)
    code, out, err = run(capsys, "--model", str(path), "--split", "2", "--prompt-ids", ",".join(map(str, prompt)),
                         "--max-new-tokens", "10", "--ignore-eos", "--json")
    assert code == 0, err
    result = json.loads(out)
    want, _ = helm_generate(path, [prompt], max_new_tokens=10)
    assert result["token_ids"] == want[0]
    assert isinstance(result["text"], str) and result["ttft_ms"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["split_k"] == 2


def test_text_prompt_streams_text(checkpoint, capsys):
    path = checkpoint("llama", "bf16")
    code, out, err = run(capsys, "--model", str(path), "--prompt", "The quick brown fox", "--max-new-tokens", "8",
                         "--temperature", "0.7", "--seed", "3")
    assert code == 0, err
    assert out.strip() and "tok/s" in err or "TTFT" in err


@pytest.mark.parametrize("raw", [False, True])
def test_a_text_prompt_is_tokenized_as_transformers_tokenizes_it(checkpoint, capsys, raw):
    """A Llama's tokenizer.json adds its BOS (id 1000 here), as transformers' tokenizer(text)
    does; --raw-text (text a chat template already formatted) adds nothing. Greedy tokens equal
    transformers' on the ids its own tokenizer gives."""
    from transformers import AutoTokenizer

    from tests.executor.helpers import hf_greedy

    path = checkpoint("llama", "fp32")
    text = "Once upon a time"
    ids = AutoTokenizer.from_pretrained(path)(text, add_special_tokens=not raw).input_ids
    assert (ids[0] == 1000) != raw
    code, out, err = run(capsys, "--model", str(path), "--prompt", text, "--max-new-tokens", "6", "--ignore-eos",
                         "--json", *(["--raw-text"] if raw else []))
    assert code == 0, err
    result = json.loads(out)
    assert result["prompt_tokens"] == len(ids) and result["token_ids"] == hf_greedy(path, ids, 6)


def test_console_script_end_to_end(checkpoint):
    path = checkpoint("mistral", "fp16")
    proc = subprocess.run([sys.executable, "-m", "executor.cli", "generate", "--model", str(path), "--split", "3",
                           "--prompt-ids", "11,12,13", "--max-new-tokens", "4", "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 4


@pytest.fixture
def broken(checkpoint, tmp_path):
    """A private copy of a tiny checkpoint that a test may damage."""
    dst = tmp_path / "model"
    shutil.copytree(checkpoint("qwen3", "fp32"), dst)
    return dst


def rewrite_weights(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def expect_error(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


IDS = ["--prompt-ids", "11,12,13", "--max-new-tokens", "2"]


def test_missing_config(capsys, tmp_path):
    expect_error(capsys, ["--model", str(tmp_path), *IDS], "model config not found")


def test_corrupt_config(capsys, broken):
    (broken / "config.json").write_text("{\"model_type\": ")
    expect_error(capsys, ["--model", str(broken), *IDS], "malformed model config")


def test_unsupported_architecture(capsys, broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (broken / "config.json").write_text(json.dumps(cfg))
    expect_error(capsys, ["--model", str(broken), *IDS], "unsupported architecture")


def test_missing_tensor(capsys, broken):
    rewrite_weights(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect_error(capsys, ["--model", str(broken), *IDS], "model.layers.1.mlp.up_proj.weight")


def test_misshaped_tensor(capsys, broken):
    def shrink(t):
        name = "model.layers.0.self_attn.k_proj.weight"
        t[name] = t[name][:-1].contiguous()
    rewrite_weights(broken, shrink)
    expect_error(capsys, ["--model", str(broken), *IDS], "has shape")


def test_corrupt_weights_file(capsys, broken):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:100])
    expect_error(capsys, ["--model", str(broken), *IDS], "cannot read")


def test_missing_weights_file(capsys, broken):
    (broken / "model.safetensors").unlink()
    expect_error(capsys, ["--model", str(broken), *IDS], "no weights")


@pytest.mark.parametrize("argv,message", [
    (["--prompt-ids", ""], "prompt is empty"),
    (["--prompt", ""], "prompt is empty"),
    (["--prompt-ids", "11,999999"], "outside the vocabulary"),
    (["--prompt-ids", "11", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "11", "--top-p", "1.5"], "top_p"),
    (["--prompt-ids", "11", "--top-k", "-2"], "top_k"),
    (["--prompt-ids", "11", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt-ids", "11", "--split", "99"], "split must be"),
])
def test_bad_requests(capsys, checkpoint, argv, message):
    expect_error(capsys, ["--model", str(checkpoint("qwen3", "fp32")), *argv], message)


def test_prompt_longer_than_context(capsys, checkpoint):
    path = checkpoint("qwen3", "fp32", max_position_embeddings=16)
    ids = ",".join(["11"] * 16)
    expect_error(capsys, ["--model", str(path), "--prompt-ids", ids], "context holds 16")


def test_generation_stops_at_context_limit(checkpoint):
    path = checkpoint("qwen3", "fp32", max_position_embeddings=16)
    got, _ = helm_generate(path, [[11] * 10], max_new_tokens=50)
    assert len(got[0]) == 6


def test_plan_gives_the_same_tokens_as_its_split(checkpoint, capsys, tmp_path):
    from planner.plan import save_plan
    from planner.planning import plan_for_split

    path = checkpoint("qwen3", "bf16")
    plan_file = tmp_path / "plan.yaml"
    save_plan(plan_for_split(str(path), split_k=3, page_size_tokens=16), plan_file)
    common = ["--model", str(path), "--prompt-ids", "11,12,13,14", "--max-new-tokens", "6", "--ignore-eos", "--json"]
    code, out, err = run(capsys, *common, "--plan", str(plan_file))
    assert code == 0, err
    planned = json.loads(out)
    code, out, err = run(capsys, *common, "--split", "3")
    assert planned["split_k"] == 3 and planned["token_ids"] == json.loads(out)["token_ids"]
    assert "measured_vs_predicted" not in json.loads(out)       # no plan, no prediction


def test_offline_generate_measures_against_its_plan(checkpoint, capsys, tmp_path):
    """The engine's step record carries what a measurement needs, so the offline run reports
    measured vs predicted per stage (and writes the report recalibration reads) like the daemon."""
    from planner.plan import save_plan
    from planner.planning import plan_for_split
    from planner.report import read_report

    path = checkpoint("qwen3", "bf16")
    plan_file, report_file = tmp_path / "plan.yaml", tmp_path / "report.json"
    save_plan(plan_for_split(str(path), split_k=3, page_size_tokens=16), plan_file)
    code, out, err = run(capsys, "--model", str(path), "--prompt-ids", "11,12,13,14", "--max-new-tokens", "6",
                         "--ignore-eos", "--json", "--plan", str(plan_file), "--report", str(report_file))
    assert code == 0, err
    rows = json.loads(out)["measured_vs_predicted"]
    assert {(r["stage"], r["phase"]) for r in rows} == {(0, "prefill"), (1, "prefill"), (0, "decode"), (1, "decode")}
    decode = [r for r in rows if r["phase"] == "decode"]
    assert sum(r["steps"] for r in decode) == 2 * 5 and all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
    report = read_report(report_file)
    assert report.steps == 6 and report.plan.split_k == 3
    expect_error(capsys, ["--model", str(path), "--prompt-ids", "11", "--split", "3", "--report", str(report_file)],
                 "--report measures against a plan's predictions")
    code, out, err = run(capsys, "--model", str(path), "--prompt-ids", "11,12", "--max-new-tokens", "2", "--json",
                         "--plan", str(plan_file), "--report", str(tmp_path / "no" / "dir" / "r.json"))
    assert code == 2 and "cannot write --report" in err and "Traceback" not in err
    assert out == ""                                              # refused before the run, not after it


def test_plan_for_another_model_is_refused(checkpoint, capsys, tmp_path):
    from planner.plan import save_plan
    from planner.planning import plan_for_split

    plan_file = tmp_path / "plan.yaml"
    save_plan(plan_for_split(str(checkpoint("llama", "bf16")), split_k=2), plan_file)
    expect_error(capsys, ["--model", str(checkpoint("qwen3", "bf16")), "--plan", str(plan_file), *IDS],
                 "plan was made for another model")


def test_invalid_plan_names_the_field(checkpoint, capsys, tmp_path):
    from planner.planning import plan_for_split

    path = checkpoint("qwen3", "bf16")
    text = plan_for_split(str(path), split_k=2).to_yaml().replace("page_size_tokens: 512", "page_size_tokens: -4")
    (tmp_path / "bad.yaml").write_text(text)
    expect_error(capsys, ["--model", str(path), "--plan", str(tmp_path / "bad.yaml"), *IDS], "page_size_tokens")
    expect_error(capsys, ["--model", str(path), "--plan", str(tmp_path / "missing.yaml"), *IDS], "plan")


def test_cpu_threads_come_from_the_plan_unless_overridden(checkpoint, capsys, tmp_path):
    """The CPU stage runs with the plan's profiled core count (capped at the CPUs this process
    may use); --threads overrides it; the count reaches the kernels and torch."""
    from executor.placement import usable_cpus
    from planner.profile import placeholder_machine
    from planner.plan import save_plan
    from planner.planning import plan_for_split

    path = checkpoint("qwen3", "bf16")
    plan = plan_for_split(str(path), split_k=6, machine=placeholder_machine(cores=64))
    plan_file = tmp_path / "plan.yaml"
    save_plan(plan, plan_file)
    common = ["--model", str(path), "--prompt-ids", "11,12", "--max-new-tokens", "2", "--json"]
    code, out, err = run(capsys, *common, "--plan", str(plan_file))
    assert code == 0, err
    assert json.loads(out)["cpu_threads"] == min(64, usable_cpus())
    code, out, err = run(capsys, *common, "--plan", str(plan_file), "--threads", "1")
    assert code == 0, err
    assert json.loads(out)["cpu_threads"] == 1 and torch.get_num_threads() == 1
    expect_error(capsys, [*common, "--threads", "0"], "threads must be >= 1")


@pytest.mark.parametrize("argv,message", [
    (["serve", "--model", "m", "--port", "70000"], "a port is 0..65535"),
    (["serve", "--model", "m", "--port", "-1"], "a port is 0..65535"),
    (["serve", "--model", "m", "--metrics-port", "65536"], "a port is 0..65535"),
    (["serve", "--model", "m", "--drain-timeout", "nan"], "seconds >= 0"),
    (["serve", "--model", "m", "--stall-timeout", "-1"], "seconds > 0"),
    (["serve", "--model", "m", "--gpu-memory", "8gb"], "is in bits"),
    (["serve", "--model", "m", "--gpu-memory", "0"], "must be a positive size"),
    (["generate", "--addr", "127.0.0.1:1", "--prompt-ids", "1", "--timeout", "inf"], "seconds > 0"),
    (["info", "--addr", "127.0.0.1:1", "--wait", "nan"], "seconds >= 0"),
    (["generate", "--model", "m", "--prompt-ids", "1", "--stop-ids", "a"], "--stop-ids: expected comma-separated"),
])
def test_flags_out_of_range_are_refused_by_name(capsys, argv, message):
    """Before: --port 70000 listened on 4464, --metrics-port 70000 was a traceback, a NaN drain
    timeout drained forever, a NaN deadline read as the daemon's DEADLINE_EXCEEDED."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--threads", "3"), ("--report", "r.json"), ("--stream-prefill", "32")])
def test_offline_flags_are_refused_with_addr(capsys, flag, value):
    """With --addr the daemon decides these: accepting them silently did nothing."""
    code = main(["generate", "--addr", "127.0.0.1:1", "--prompt-ids", "1", flag, value])
    assert code == 2 and f"{flag}: offline only" in capsys.readouterr().err


def test_credentials_from_pipes_are_read_and_never_waited_on_forever(tmp_path, monkeypatch):
    """A client's token may come from a pipe (`--token-file <(pass show helm)`, /dev/stdin): read to
    its end. A FIFO nobody writes to is given up after PIPE_WAIT_S, /dev/zero at the size limit;
    the daemon's own token file must be a regular file. Before: a FIFO blocked the client, and the
    daemon's start, forever."""
    import os

    from executor.errors import CredentialError
    from executor.server import auth
    from executor.server.auth import Tokens, read_credential

    def client(token_file, stdin=None):
        return subprocess.run([sys.executable, "-m", "executor.cli", "info", "--addr", "127.0.0.1:1",
                               "--token-file", token_file], input=stdin, capture_output=True, text=True, timeout=60)

    piped = client("/dev/stdin", stdin="a-token-from-a-pipe\n")
    assert piped.returncode == 2 and "UNAVAILABLE" in piped.stderr  # read, then the call failed: no daemon
    out = client("/dev/zero")
    assert out.returncode == 2 and "more than" in out.stderr and "Traceback" not in out.stderr
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    monkeypatch.setattr(auth, "PIPE_WAIT_S", 0.3)
    with pytest.raises(CredentialError, match="did not end within 0.3 s"):
        read_credential(fifo, "the token file", pipes=True)
    with pytest.raises(CredentialError, match="not a regular file"):
        Tokens.from_file(fifo)


def test_an_unwritable_report_is_refused_before_the_generation(checkpoint, capsys, tmp_path):
    from planner.plan import save_plan
    from planner.planning import plan_for_split

    path = checkpoint("qwen3", "fp32")
    plan = tmp_path / "plan.yaml"
    save_plan(plan_for_split(path, 2), plan)
    code, out, err = run(capsys, "--model", str(path), "--plan", str(plan), "--prompt-ids", "1,2,3",
                         "--report", str(tmp_path))  # a directory
    assert code == 2 and "cannot write --report" in err and "is a directory" in err and out == ""


def test_client_commands_never_load_torch():
    """A client of a daemon needs gRPC, not torch (1.2 s of imports on every call)."""
    code = ("import sys\nfrom executor.cli import main\n"
            "for argv in (['generate', '--addr', '127.0.0.1:1', '--prompt-ids', '1', '--timeout', '1'],\n"
            "             ['info', '--addr', '127.0.0.1:1'], ['report', '--addr', '127.0.0.1:1']):\n"
            "    assert main(argv) == 2\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_stream_prefill_goes_with_a_split_not_a_plan(checkpoint, capsys, tmp_path, monkeypatch):
    """--stream-prefill N sets a --split run's policy (streamed only where CUDA and flash attention
    are: the tokens are the same either way); a plan states its own, so with --plan it is refused,
    as it is without --split, and N must be a token count."""
    from executor import loader

    placements = []
    load = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda path, placement, *a, **k: (placements.append(placement),
                                                                               load(path, placement, *a, **k))[1])
    path = checkpoint("qwen3", "fp32")
    prompt = ",".join(map(str, prompt_ids(12, 256, seed=8)))
    code, out, err = run(capsys, "--model", str(path), "--split", "3", "--stream-prefill", "4", "--prompt-ids", prompt,
                         "--max-new-tokens", "6", "--ignore-eos", "--json")
    assert code == 0, err
    assert [p.stream_prefill_min_rows for p in placements] == [4]
    want, _ = helm_generate(path, [prompt_ids(12, 256, seed=8)], split=3, max_new_tokens=6)
    assert json.loads(out)["token_ids"] == want[0]
    code, _, err = run(capsys, "--model", str(path), "--split", "3", "--stream-prefill", "0", "--prompt-ids", prompt)
    assert code == 2 and "at least 1 token" in err
    code, _, err = run(capsys, "--model", str(path), "--stream-prefill", "4", "--prompt-ids", prompt)
    assert code == 2 and "--stream-prefill goes with --split" in err
    plan = tmp_path / "plan.yaml"
    from planner.planning import plan_for_split
    from planner.plan import save_plan
    save_plan(plan_for_split(str(path), split_k=3), plan)
    code, _, err = run(capsys, "--model", str(path), "--plan", str(plan), "--stream-prefill", "4", "--prompt-ids", prompt)
    assert code == 2 and "--stream-prefill goes with --split" in err
