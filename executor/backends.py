"""The compute backend of a stage: its linear operator and element-wise ops.

"torch" is the reference path (plain PyTorch, any device); "helm" runs the CPU stage on our
Cython SIMD kernels (executor.kernels), with the same fp32-activation semantics. A stage is
given one backend object and never asks which it is, so the kernels plug in behind the same
stage code.
"""
from __future__ import annotations

import importlib
import logging

import torch

from executor import ops

log = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return ops.TorchLinear(weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops.rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(gate, up)

    @staticmethod
    def add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.add_(y)


class KernelLinear:
    """y = x @ W.T + b through executor.kernels (fp32 activations, fp32 accumulation)."""

    def __init__(self, kernels, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int):
        self._linear = kernels.linear
        self.weight = weight
        self.prepared = kernels.prepare_linear(weight, bias)
        self.num_threads = num_threads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x.contiguous(), self.prepared, num_threads=self.num_threads)


class KernelBackend:
    """CPU only. Threads: passed explicitly to every kernel (default: torch's thread count)."""

    name = "helm"

    def __init__(self, num_threads: int | None = None):
        from executor import kernels

        self.kernels = kernels
        self.isa = kernels.KERNEL_ISA
        self.num_threads = num_threads or torch.get_num_threads()

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return KernelLinear(self.kernels, weight, bias, self.num_threads)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, eps, num_threads=self.num_threads)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate, up, num_threads=self.num_threads)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.kernels.add_(x, y.contiguous(), num_threads=self.num_threads)


def resolve_backend(backend: str = "auto") -> str:
    """"auto": our kernels when the compiled extension loads, else the PyTorch reference path."""
    if backend not in ("auto", "helm", "torch"):
        raise ValueError(f"kernel backend must be auto, helm or torch, got {backend!r}")
    if backend != "auto":
        return backend
    try:
        importlib.import_module("executor.kernels")  # does the compiled extension load?
    except ImportError as e:
        log.warning("CPU kernels unavailable, using PyTorch ops: %s", e)
        return "torch"
    return "helm"


def make_backend(name: str, device: torch.device):
    """The backend object for a stage on `device` (CUDA stages always use PyTorch)."""
    if device.type != "cpu" or name == "torch":
        return TorchBackend()
    if name == "helm":
        return KernelBackend()
    raise ValueError(f"unknown kernel backend {name!r}")
