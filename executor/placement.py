"""Where each partition unit runs: the executor's view of a plan.

A `Placement` is derived either from a plan file written by `helm-plan` (the one plan type, in
`planner/`) or, without a plan, from `--split K`: K leading units on the CPU, the rest on the
GPU. A GPU stage on a machine without CUDA runs the very same code on the CPU, so two-stage
execution (hand-off, device and host KV pools) is exercised everywhere.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from executor.errors import PlacementError
from planner.step_shape import PREFILL_CHUNK_TOKENS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSpec:
    device: str  # "cpu" | "cuda" as planned
    unit_start: int
    unit_end: int  # exclusive


@dataclass(frozen=True)
class KernelChoice:
    """What the CPU kernels take by measurement (executor/probe.py), as the plan's machine profile
    recorded it: the prompt-GEMM route per weight dtype, (dtype name, path, min_rows), and the
    longest chunk of a sequence's queries the attention kernel takes; with the kernel ISA and the
    threads they were measured with (elsewhere they are measured again at load)."""
    isa: str
    threads: int
    gemm_routes: tuple[tuple[str, str, int], ...]
    attention_max_queries: int


@dataclass(frozen=True)
class Placement:
    stages: tuple[StageSpec, ...]
    num_units: int
    page_size_tokens: int = 512
    device_kv_pages: int | None = None  # KV pages the GPU-side stage holds in VRAM (offload: the rest
                                        # park in host memory); None: every page stays where it is made
    # The plan's KV budget, what the planner checked fits its memory: `kv_sequences` sequences
    # (its batch) of `context_tokens` each, which is also the longest a sequence may grow.
    # None: unbounded (a run without a plan, `--split`).
    kv_sequences: int | None = None
    context_tokens: int | None = None
    # Sequences the plan's working sets are priced for (planner.step_shape.running_sequences of its
    # KV budget in its own pages, which a --page-size override does not change); None: no plan
    max_running: int | None = None
    # What the plan's profile says of flash attention on its GPU (GpuProfile.flash_attention): False,
    # the plan priced the GPU stage's prompt chunks streamed, so they stream; None: no plan, or not known
    flash_attention: bool | None = None
    cpu_threads: int | None = None  # threads of the CPU stages' kernels (and torch); None: torch's count
    kernel_choice: KernelChoice | None = None  # the plan's profile's; None: measured at load
    # Prompt steps of at least this many tokens run the CPU stages' blocks on the GPU, their weights
    # streamed (executor/streamed_prefill.py; the plan's prefill policy); None: on the CPU
    stream_prefill_min_rows: int | None = None
    # ... of up to this many tokens a step (a prompt's chunks are this large while they stream: the
    # plan's, what its GPU memory holds); None: a prompt chunk (PREFILL_CHUNK_TOKENS)
    stream_prefill_step_tokens: int | None = None

    @property
    def split_k(self) -> int:
        return sum(s.unit_end - s.unit_start for s in self.stages if s.device == "cpu")

    @classmethod
    def from_split(cls, num_units: int, split_k: int, page_size_tokens: int = 512,
                   device_kv_pages: int | None = None) -> "Placement":
        if isinstance(split_k, bool) or not isinstance(split_k, int) or not 0 <= split_k <= num_units:
            raise PlacementError(f"split must be an integer in 0..{num_units} (units on the CPU), got {split_k!r}")
        stages = []
        if split_k > 0:
            stages.append(StageSpec("cpu", 0, split_k))
        if split_k < num_units:
            stages.append(StageSpec("cuda", split_k, num_units))
        placement = cls(tuple(stages), num_units, page_size_tokens, device_kv_pages)
        placement.validate()
        return placement

    def validate(self) -> None:
        if not self.stages:
            raise PlacementError("a placement needs at least one stage")
        expected = 0
        for s in self.stages:
            if s.device not in ("cpu", "cuda"):
                raise PlacementError(f"stage device must be 'cpu' or 'cuda', got {s.device!r}")
            if s.unit_start != expected or s.unit_end <= s.unit_start:
                raise PlacementError(
                    f"stages must cover units 0..{self.num_units - 1} contiguously; "
                    f"found a stage {s.unit_start}..{s.unit_end - 1} after unit {expected - 1}"
                )
            expected = s.unit_end
        if expected != self.num_units:
            raise PlacementError(f"stages cover units 0..{expected - 1}, the model has {self.num_units}")
        if self.page_size_tokens < 1:
            raise PlacementError(f"KV page size must be >= 1 token, got {self.page_size_tokens}")
        if self.device_kv_pages is not None and self.device_kv_pages < 1:
            raise PlacementError(f"device KV pages must be >= 1, got {self.device_kv_pages}")
        if self.context_tokens is not None and self.context_tokens < 2:
            raise PlacementError(f"the context must hold at least 2 tokens, got {self.context_tokens}")
        if (self.kv_sequences is None) != (self.context_tokens is None) or \
                (self.kv_sequences is not None and self.kv_sequences < 1):
            raise PlacementError("a KV budget needs both a batch of at least 1 sequence and a context")
        if self.max_running is not None and self.max_running < 1:
            raise PlacementError(f"a running batch needs at least 1 sequence, got {self.max_running}")
        if self.stream_prefill_min_rows is not None and self.stream_prefill_min_rows < 1:
            raise PlacementError(f"streamed prompt steps need at least 1 token, got {self.stream_prefill_min_rows}")
        if self.stream_prefill_step_tokens is not None and self.stream_prefill_step_tokens < 1:
            raise PlacementError(f"a streamed prompt step takes at least 1 token, got {self.stream_prefill_step_tokens}")
        step = self.stream_prefill_step_tokens or PREFILL_CHUNK_TOKENS
        if self.stream_prefill_min_rows is not None and step < self.stream_prefill_min_rows:
            raise PlacementError(f"prompt steps stream from {self.stream_prefill_min_rows} tokens but take at most "
                                 f"{step}: none would stream")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise PlacementError(f"CPU threads must be >= 1, got {self.cpu_threads}")

    @property
    def kv_budget_pages(self) -> int | None:
        """Pages every stage may hold over all sequences: the plan's batch, each at its context
        (None: unbounded)."""
        if self.kv_sequences is None or self.context_tokens is None:
            return None
        return self.kv_sequences * -(-self.context_tokens // self.page_size_tokens)

    def with_threads(self, requested: int | None) -> "Placement":
        """This placement with `requested` CPU threads (None keeps the current choice), never more
        than the CPUs this process may run on: more threads than cores only make OpenMP spin."""
        threads = requested if requested is not None else self.cpu_threads
        if threads is None:
            return self
        usable = usable_cpus()
        if threads > usable:
            log.warning("%d CPU threads requested, this process may use %d CPUs: using %d", threads, usable, usable)
            threads = usable
        placement = replace(self, cpu_threads=threads)
        placement.validate()
        return placement


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_device(planned: str) -> torch.device:
    """The device a planned stage runs on here: CUDA when present, else the CPU."""
    if planned == "cuda" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")
