"""Host → CUDA copies through a reused page-locked buffer.

A copy from pageable memory makes the host wait for it; from page-locked memory it is queued and
the host goes on. The buffer is reused from copy to copy, so it is refilled only once an event
says the last copy out of it is done (the engine reads each step's results back, so that has long
happened; a caller that does not must not find its data overwritten).
"""
from __future__ import annotations

import torch


class PinnedStaging:
    """One reused page-locked buffer for copies of host tensors to `device` (CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buf: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last copy out of the buffer

    def to_device(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (host memory) on the device, asynchronously: copied into `out` where given (a CUDA
        graph's static input), else into a new tensor; returns it."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._buf is None or self._buf.numel() < x.numel() or self._buf.dtype != x.dtype:
            self._buf = torch.empty(max(x.numel(), 1024), dtype=x.dtype, pin_memory=True)
        staged = self._buf[: x.numel()].view_as(x)
        staged.copy_(x)
        if out is None:
            out = staged.to(self.device, non_blocking=True)
        else:
            out.copy_(staged, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return out
