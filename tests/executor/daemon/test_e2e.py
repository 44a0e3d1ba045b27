"""The real daemon on a loopback port, driven by a client generated from the proto: streamed
tokens equal offline generation, concurrent streams, cancel and deadline free KV pages, plan
swaps under load, status codes for bad requests, reports, reflection and the CLI client."""
from __future__ import annotations

import json
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from executor.cli import main
from executor.pb import executor_pb2 as pb
from executor.request_params import SamplingParams
from executor.server.client import ExecutorClient
from executor.tokenizer import Tokenizer
from planner.plan import load_plan
from planner.report import validate_report
from tests.executor.daemon.helpers import PAGE_SIZE, collect, serving_daemon, wait_until, write_plan
from tests.executor.helpers import helm_generate, prompt_ids

RPC_TIMEOUT_S = 60
SERVICE = "helm.executor.v1.ExecutorService"


@pytest.fixture(scope="module")
def plans(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    return {k: write_plan(model, k, d / f"split{k}.yaml") for k in (2, 4)}


@pytest.fixture(scope="module")
def daemon(plans, tmp_path_factory):
    with serving_daemon(["--plan", str(plans[2]), "--plan-dir", str(plans[2].parent)],
                        tmp_path_factory.mktemp("daemon") / "daemon.log") as proc:
        yield proc


def ids_request(prompt, max_new_tokens, request_id="", **sampling):
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingParameters(**sampling),
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True))


def offline(model, prompt, max_new_tokens, split=2, sampling=None):
    out, _ = helm_generate(model, [prompt], split=split, sampling=sampling, max_new_tokens=max_new_tokens,
                           page_size=PAGE_SIZE)
    return out[0]


def kv_in_use(client):
    """Pages requests hold, and requests holding pages (kept prompt prefixes aside: no request holds them)."""
    info = client.info()
    return sum(s.kv.device_pages_used + s.kv.host_pages_used - s.kv.cached_pages + s.kv.sequences
               for s in info.stages if s.HasField("kv"))


def test_health_reflection_and_info(client, model, plans):
    assert client.health_status("") == health_pb2.HealthCheckResponse.SERVING
    assert client.health_status(SERVICE) == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = ProtoReflectionDescriptorDatabase(client.channel).get_services()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    info = client.info()
    plan = load_plan(plans[2])
    assert info.state == pb.SERVING_STATE_SERVING
    assert info.model.architecture == "Qwen3ForCausalLM" and info.model.vocab_size == 1024
    assert info.plan.digest == plan.digest and info.plan.split_k == 2 and info.plan.version == 1
    assert [(s.planned_device, s.unit_start, s.unit_end) for s in info.stages] == [(pb.DEVICE_CPU, 0, 2),
                                                                                   (pb.DEVICE_CUDA, 2, 6)]
    assert info.stages[1].kv.page_size_tokens == PAGE_SIZE and info.kernel_isa
    got = client.get_plan()
    assert got.plan.digest == plan.digest and load_plan(got.yaml).digest == plan.digest


def test_streamed_tokens_equal_offline_generation(client, model):
    prompt = prompt_ids(11, 256, seed=1)
    request = ids_request(prompt, 24, temperature=0.8, top_p=0.9, seed=7)
    ids, text, result = collect(client.stub.Generate(request, timeout=RPC_TIMEOUT_S))
    assert ids == offline(model, prompt, 24, sampling=SamplingParams(0.8, 0, 0.9, 7))
    assert result.finish_reason == pb.FINISH_REASON_LENGTH
    assert (result.prompt_tokens, result.completion_tokens) == (11, 24)
    assert result.ttft_ns > 0 and result.decode_tokens_per_s > 0 and result.total_ns >= result.ttft_ns
    assert [s.device for s in result.stages] == [pb.DEVICE_CPU, pb.DEVICE_CUDA]
    assert all(s.steps == 24 and s.measured_mean_ns > 0 and s.predicted_mean_ns > 0 for s in result.stages)
    assert Tokenizer(model).decode(ids).startswith(text + result.trailing_text)
    greedy = collect(client.stub.Generate(ids_request(prompt, 16), timeout=RPC_TIMEOUT_S))[0]
    assert greedy == offline(model, prompt, 16)  # no sampling parameters: greedy


def test_text_prompt_and_stop_string(client, model):
    tok = Tokenizer(model)
    prompt = "The history of the river valley"
    request = pb.GenerateRequest(text=prompt, stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True))
    ids, text, result = collect(client.stub.Generate(request, timeout=RPC_TIMEOUT_S))
    assert ids == offline(model, tok.encode(prompt), 40)
    full = text + result.trailing_text
    # A stop string that spans a token boundary, from the middle of the text.
    bounds = [len(tok.decode(ids[:n])) for n in range(len(ids) + 1)]
    cut = next(b for b in bounds if len(full) // 3 < b < len(full) - 2)
    stop = full[cut - 2:cut + 2]
    request.stopping.stop_strings.append(stop)
    ids2, text2, result2 = collect(client.stub.Generate(request, timeout=RPC_TIMEOUT_S))
    assert result2.finish_reason == pb.FINISH_REASON_STOP_STRING and result2.stop_string == stop
    assert text2 + result2.trailing_text == full[:full.index(stop)]
    assert ids2 == ids[:len(ids2)] and len(ids2) < len(ids)
    # A stop token id ends the generation with the id included.
    del request.stopping.stop_strings[:]
    request.stopping.stop_token_ids.append(ids[5])
    ids3, _, result3 = collect(client.stub.Generate(request, timeout=RPC_TIMEOUT_S))
    assert result3.finish_reason == pb.FINISH_REASON_STOP and ids3 == ids[:ids.index(ids[5]) + 1]


def test_sixteen_concurrent_streams(client, model):
    prompts = [prompt_ids(5 + i, 256, seed=100 + i) for i in range(16)]
    results, errors = [None] * 16, []

    def run(i):
        try:
            results[i] = collect(client.stub.Generate(ids_request(prompts[i], 20, request_id=f"c{i}"),
                                                      timeout=RPC_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RPC_TIMEOUT_S)
    assert not errors and all(r is not None for r in results)
    for prompt, (ids, _, result) in zip(prompts, results):
        assert result.finish_reason == pb.FINISH_REASON_LENGTH
        assert ids == offline(model, prompt, 20)
    report = client.report()
    assert max(r.batch_mean for r in report.rows if r.phase == "decode") > 1  # they were batched
    wait_until(lambda: kv_in_use(client) == 0, what="every page freed")


def test_cancel_disconnect_and_deadline_free_pages(client, daemon):
    stream = client.stub.Generate(ids_request(prompt_ids(40, 256, seed=3), 1500), timeout=RPC_TIMEOUT_S)
    for _, msg in zip(range(5), stream):
        assert msg.HasField("token")
    info = client.info()
    assert info.stages[1].kv.sequences == 1 and info.stages[1].kv.device_pages_used >= 3
    stream.cancel()
    wait_until(lambda: kv_in_use(client) == 0, timeout_s=10, what="pages freed after cancel")

    with ExecutorClient(daemon.addr) as other:  # a client that disconnects mid-stream
        stream = other.stub.Generate(ids_request(prompt_ids(40, 256, seed=3), 1500), timeout=RPC_TIMEOUT_S)
        assert next(stream).HasField("token")
    wait_until(lambda: kv_in_use(client) == 0, timeout_s=10, what="pages freed after a disconnect")

    with pytest.raises(grpc.RpcError) as err:
        collect(client.stub.Generate(ids_request(prompt_ids(40, 256, seed=4), 1500), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: kv_in_use(client) == 0, timeout_s=10, what="pages freed after the deadline")


BAD_REQUESTS = [
    ("no prompt", pb.GenerateRequest(), "no prompt"),
    ("empty ids", pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids is empty"),
    ("empty text", pb.GenerateRequest(text=""), "empty"),
    ("out of vocabulary", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[11, 5000])), "outside the vocabulary"),
    ("temperature", pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(temperature=-1)), "temperature"),
    ("top_p zero", pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(top_p=0)), "top_p"),
    ("top_p above one", pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(top_p=1.5)), "top_p"),
    ("seed", pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(seed=2**63)), "seed"),
    ("max_new_tokens zero", pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_new_tokens=0)),
     "max_new_tokens"),
    ("over the context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[11] * 100),
                                            stopping=pb.StoppingCriteria(max_new_tokens=2000)), "context"),
    ("empty stop string", pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(stop_strings=[""])),
     "stop_strings"),
    ("long request_id", pb.GenerateRequest(request_id="r" * (1 << 20), text="hi"), "request_id must be at most 128"),
    ("request_id with a newline", pb.GenerateRequest(request_id="a\nb", text="hi"), "printable ASCII"),
    ("too many stop strings", pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(
        stop_strings=[f"s{i}" for i in range(10000)])), "at most 16 strings"),
    ("long stop string", pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(stop_strings=["x" * 65])),
     "at most 64 characters"),
    ("too many stop ids", pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(stop_token_ids=[1] * 257)),
     "at most 256 ids"),
    ("stop id outside the vocabulary", pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(
        stop_token_ids=[5000])), "stop token ids must be in [0, 1024)"),
    ("prompt text over its byte limit", pb.GenerateRequest(text="word " * 7000), "bytes (16 per token"),
]


@pytest.mark.parametrize("name,request_,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_invalid_argument(client, name, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        collect(client.stub.Generate(request_, timeout=RPC_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()


def test_bad_plans_leave_the_old_plan_serving(client, plans, model, checkpoint, tmp_path):
    before = client.info().plan.digest
    with pytest.raises(grpc.RpcError) as err:
        client.load_plan(path=str(tmp_path / "missing.yaml"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    broken = plans[2].read_text().replace("split_k: 2", "split_k: -2")
    with pytest.raises(grpc.RpcError) as err:
        client.load_plan(yaml=broken)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "partition.split_k" in err.value.details()
    other = write_plan(checkpoint("llama", "fp32"), 2, tmp_path / "llama.yaml")
    with pytest.raises(grpc.RpcError) as err:
        client.load_plan(yaml=other.read_text())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "another model" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.report("sha256:" + "0" * 64)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert client.info().plan.digest == before
    ids, _, _ = collect(client.stub.Generate(ids_request([11, 12, 13], 4), timeout=RPC_TIMEOUT_S))
    assert ids == offline(model, [11, 12, 13], 4)  # still serving


def test_plan_swap_under_load_loses_no_request(client, model, plans):
    old, new = load_plan(plans[2]), load_plan(plans[4])
    prompts = [prompt_ids(6 + i, 256, seed=200 + i) for i in range(8)]
    streams = [client.stub.Generate(ids_request(p, 48), timeout=RPC_TIMEOUT_S) for p in prompts]
    firsts = [next(s) for s in streams]  # every request is running on the old plan
    assert all(m.HasField("token") for m in firsts)
    swapped = client.load_plan(yaml=plans[4].read_text())
    assert swapped.plan.digest == new.digest and swapped.previous_digest == old.digest
    assert swapped.plan.source == "inline" and swapped.load_ns > 0
    after = client.stub.Generate(ids_request(prompts[0], 48), timeout=RPC_TIMEOUT_S)
    for prompt, first, stream in zip(prompts, firsts, streams):
        ids, _, result = collect(stream)
        assert [first.token.token_id] + ids == offline(model, prompt, 48, split=2)
        assert result.plan.digest == old.digest and result.finish_reason == pb.FINISH_REASON_LENGTH
    ids, _, result = collect(after)
    assert result.plan.digest == new.digest and ids == offline(model, prompts[0], 48, split=4)
    info = client.info()
    assert info.plan.digest == new.digest and info.plan.split_k == 4
    assert [(s.unit_start, s.unit_end) for s in info.stages] == [(0, 4), (4, 6)]
    assert client.report(old.digest).steps > 0 and client.report().plan.digest == new.digest
    client.load_plan(path=plans[2].name)  # back to the module's plan (a path inside --plan-dir)
    assert client.info().plan.digest == old.digest


def test_report_cli_writes_a_schema_valid_report(daemon, client, capsys, tmp_path):
    collect(client.stub.Generate(ids_request(prompt_ids(20, 256, seed=5), 8), timeout=RPC_TIMEOUT_S))
    out = tmp_path / "report.json"
    assert main(["report", "--addr", daemon.addr, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    validate_report(data)
    assert data["plan"]["digest"] == client.info().plan.digest and data["steps"] > 0
    decode = [r for r in data["rows"] if r["phase"] == "decode"]
    assert {r["stage"] for r in decode} == {0, 1} and all(r["predicted_ms"] > 0 for r in decode)
    assert "decode" in printed and "predicted" in printed
    unwritable = tmp_path / "no such directory" / "report.json"
    assert main(["report", "--addr", daemon.addr, "-o", str(unwritable)]) == 2
    assert "cannot write -o" in capsys.readouterr().err


def test_generate_cli_streams_from_the_daemon(daemon, model, capsys):
    prompt = prompt_ids(9, 256, seed=6)
    code = main(["generate", "--addr", daemon.addr, "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "12", "--ignore-eos", "--temperature", "0.7", "--seed", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["token_ids"] == offline(model, prompt, 12, sampling=SamplingParams(0.7, 0, 1.0, 3))
    assert result["finish_reason"] == "length" and len(result["stages"]) == 2
    code = main(["generate", "--addr", daemon.addr, "--prompt", "Once upon a time", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and "predicted" in err
    code = main(["generate", "--addr", daemon.addr, "--prompt-ids", "11,5000"])
    assert code == 2 and "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["info", "--addr", daemon.addr, "--wait", "10"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["state"] == "SERVING_STATE_SERVING" and info["plan"]["split_k"] == 2
