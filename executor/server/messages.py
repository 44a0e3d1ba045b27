"""The daemon's domain types and their protobuf forms (helm.executor.v1).

Each type owns its conversion (`from_pb` for what arrives, `to_pb` for what leaves), so the gRPC
servicer only converts and delegates. `pb` is the generated module `executor.pb.executor_pb2`,
passed in so that this module imports without generated code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor.errors import RequestError
from executor.request_params import SamplingParams, StopCriteria

if TYPE_CHECKING:  # the client commands import this module without torch
    from executor.kv_cache import KVStats
from planner.plan import Plan
from planner.report import PlanSummary, device_name

FINISH_REASONS = ("stop", "stop_string", "length", "context", "aborted")

# Limits on what a request may ask for, checked before any work (named in executor.proto). The
# prompt's text has one more, per model: MAX_PROMPT_BYTES_PER_TOKEN bytes per context token.
MAX_REQUEST_ID_CHARS = 128  # printable ASCII: the id is logged and sent back with every token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 64  # each token's text is checked against every suffix of every stop string
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPT_BYTES_PER_TOKEN = 16  # ordinary text is 3-6 bytes per token: the context fills first


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def finish_reason_pb(reason: str, pb) -> int:
    return pb.FinishReason.Value(f"FINISH_REASON_{reason.upper()}")


def finish_reason_name(value: int, pb) -> str:
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


@dataclass(frozen=True)
class GenerateSpec:
    """One prompt to complete, as a client asked for it."""
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    sampling: SamplingParams
    stop: StopCriteria
    stop_strings: tuple[str, ...] = ()
    request_id: str = ""  # "": the daemon assigns one
    raw_text: bool = False  # the text as it is: no special tokens added

    @classmethod
    def from_pb(cls, msg) -> "GenerateSpec":
        which = msg.WhichOneof("prompt")
        if which is None:
            raise RequestError("the request has no prompt: set prompt text or token_ids")
        request_id = msg.request_id
        if len(request_id) > MAX_REQUEST_ID_CHARS or not all(" " < c <= "~" for c in request_id):
            raise RequestError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters "
                               "without spaces")
        stops = tuple(msg.stopping.stop_strings)
        if any(s == "" for s in stops):
            raise RequestError("stopping.stop_strings must not contain an empty string")
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise RequestError(f"stopping.stop_strings: at most {MAX_STOP_STRINGS} strings of at most "
                               f"{MAX_STOP_STRING_CHARS} characters each")
        if len(msg.stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stopping.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
        return cls(prompt_text=msg.text if which == "text" else None,
                   prompt_ids=tuple(msg.token_ids.ids) if which == "token_ids" else None,
                   sampling=SamplingParams.from_pb(msg.sampling), stop=StopCriteria.from_pb(msg.stopping),
                   stop_strings=stops, request_id=request_id, raw_text=msg.raw_text)

    def to_pb(self, pb):
        s, st = self.sampling, self.stop
        sampling = pb.SamplingParameters(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        if s.seed is not None:
            sampling.seed = s.seed
        stopping = pb.StoppingCriteria(max_new_tokens=st.max_new_tokens, stop_token_ids=st.stop_token_ids,
                                       stop_strings=self.stop_strings, ignore_eos=st.ignore_eos)
        msg = pb.GenerateRequest(request_id=self.request_id, sampling=sampling, stopping=stopping,
                                 raw_text=self.raw_text)
        if self.prompt_text is not None:
            msg.text = self.prompt_text
        else:
            msg.token_ids.ids.extend(self.prompt_ids or ())
        return msg


@dataclass(frozen=True)
class TokenChunk:
    """One token as it was produced, with the text it completes (may be '' while held back)."""
    token_id: int
    text: str
    index: int
    elapsed_s: float  # since the daemon accepted the request

    def to_pb(self, pb, request_id: str):
        return pb.GenerateResponse(request_id=request_id, token=pb.GeneratedToken(
            token_id=self.token_id, text=self.text, index=self.index, elapsed_ns=_ns(self.elapsed_s)))


@dataclass(frozen=True)
class StageTiming:
    """Mean measured and predicted time of one stage per step, over one request's steps."""
    stage: int
    device: str  # as planned
    steps: int
    measured_ms: float
    predicted_ms: float

    def to_pb(self, pb):
        return pb.StageTiming(stage=self.stage, device=pb.Device.Value(f"DEVICE_{self.device.upper()}"),
                              steps=self.steps, measured_mean_ns=round(self.measured_ms * 1e6),
                              predicted_mean_ns=round(self.predicted_ms * 1e6))

    @classmethod
    def from_pb(cls, msg, pb) -> "StageTiming":
        return cls(msg.stage, device_name(msg.device, pb), msg.steps, msg.measured_mean_ns / 1e6,
                   msg.predicted_mean_ns / 1e6)


@dataclass(frozen=True)
class GenerationResult:
    """How a generation ended, with its timings (the stream's last message)."""
    finish_reason: str  # one of FINISH_REASONS
    stop_string: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # of prompt_tokens: K/V reused from an earlier request's, not computed
    trailing_text: str
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float
    stages: tuple[StageTiming, ...]
    plan: PlanSummary

    def to_pb(self, pb, request_id: str):
        return pb.GenerateResponse(request_id=request_id, result=pb.GenerationResult(
            finish_reason=finish_reason_pb(self.finish_reason, pb), stop_string=self.stop_string,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens, trailing_text=self.trailing_text, ttft_ns=_ns(self.ttft_s), decode_tokens_per_s=self.decode_tokens_per_s,
            total_ns=_ns(self.total_s), stages=[s.to_pb(pb) for s in self.stages], plan=self.plan.to_pb(pb)))

    @classmethod
    def from_pb(cls, msg, pb) -> "GenerationResult":
        return cls(finish_reason_name(msg.finish_reason, pb), msg.stop_string, msg.prompt_tokens,
                   msg.completion_tokens, msg.cached_prompt_tokens, msg.trailing_text, msg.ttft_ns / 1e9, msg.decode_tokens_per_s,
                   msg.total_ns / 1e9, tuple(StageTiming.from_pb(s, pb) for s in msg.stages),
                   PlanSummary.from_pb(msg.plan))


@dataclass(frozen=True)
class StageInfo:
    """One stage of the plan serving, with its KV pages now."""
    index: int
    planned_device: str
    device: str  # where it runs here: "cpu", "cuda:0"
    unit_start: int
    unit_end: int
    backend: str
    page_size_tokens: int
    kv: KVStats | None

    def to_pb(self, pb):
        msg = pb.StageInfo(index=self.index, planned_device=pb.Device.Value(f"DEVICE_{self.planned_device.upper()}"),
                           device=self.device, unit_start=self.unit_start, unit_end=self.unit_end,
                           backend=self.backend)
        if self.kv is not None:
            kv = self.kv
            msg.kv.CopyFrom(pb.KVPages(page_size_tokens=self.page_size_tokens, device_pages_used=kv.device_pages_used,
                                       host_pages_used=kv.host_pages_used, evictions=kv.evictions,
                                       sequences=kv.sequences, cached_pages=kv.cached_pages))
            if kv.device_pages_capacity is not None:
                msg.kv.device_pages_capacity = kv.device_pages_capacity
                msg.kv.device_pages_free = max(0, kv.device_pages_capacity - kv.device_pages_used)
        return msg


@dataclass(frozen=True)
class ServerInfo:
    state: str  # "loading" | "serving" | "draining"
    architecture: str
    model_dir: str
    dtype: str
    num_layers: int
    vocab_size: int
    context_tokens: int
    has_tokenizer: bool
    plan: PlanSummary | None
    stages: tuple[StageInfo, ...]
    kernel_isa: str
    waiting: int
    running: int
    max_batch: int
    max_queue: int
    on_previous_plans: int
    uptime_s: float
    version: str

    def to_pb(self, pb):
        msg = pb.InfoResponse(
            state=pb.ServingState.Value(f"SERVING_STATE_{self.state.upper()}"),
            model=pb.ModelInfo(architecture=self.architecture, directory=self.model_dir, dtype=self.dtype,
                               num_layers=self.num_layers, vocab_size=self.vocab_size,
                               context_tokens=self.context_tokens, has_tokenizer=self.has_tokenizer),
            stages=[s.to_pb(pb) for s in self.stages], kernel_isa=self.kernel_isa,
            queue=pb.QueueInfo(waiting=self.waiting, running=self.running, max_batch=self.max_batch,
                               max_queue=self.max_queue, on_previous_plans=self.on_previous_plans),
            uptime_ns=_ns(self.uptime_s), version=self.version)
        if self.plan is not None:
            msg.plan.CopyFrom(self.plan.to_pb(pb))
        return msg


@dataclass(frozen=True)
class LoadResult:
    plan: PlanSummary
    previous_digest: str | None
    load_s: float
    warmup_s: float

    def to_pb(self, pb):
        return pb.LoadPlanResponse(plan=self.plan.to_pb(pb), previous_digest=self.previous_digest or "",
                                   load_ns=_ns(self.load_s), warmup_ns=_ns(self.warmup_s))


MAX_PLAN_PATH_CHARS = 1024


@dataclass(frozen=True)
class PlanSource:
    """Where LoadPlan reads a plan: a path inside the daemon's --plan-dir, or the YAML itself
    (`name`: what the YAML is called in logs and reports; default "inline"); or, in process only
    (serve --plan, read once), the parsed plan."""
    path: str | None = None
    yaml: str | None = None
    name: str | None = None
    plan: Plan | None = None

    @classmethod
    def from_pb(cls, msg) -> "PlanSource":
        which = msg.WhichOneof("source")
        if which is None:
            raise RequestError("LoadPlan needs a plan: set path or yaml")
        if which == "path":
            if not msg.path:
                raise RequestError("path is empty")
            if len(msg.path) > MAX_PLAN_PATH_CHARS:
                raise RequestError(f"path is longer than {MAX_PLAN_PATH_CHARS} characters")
            return cls(path=msg.path)
        return cls(yaml=msg.yaml)

    @property
    def label(self) -> str:
        return self.path if self.path is not None else self.name or "inline"
