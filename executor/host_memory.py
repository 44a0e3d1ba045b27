"""Host tensors that start on a page boundary and own their pages.

The CUDA driver page-locks whole pages (cudaHostRegister), and refuses a range that shares a page
with one already registered. Tensors from PyTorch's CPU allocator come from malloc, which places
small and mid-sized blocks side by side in its heap (and, once a process has freed large blocks,
blocks of up to 32 MiB too), so two of them can share a page: the second would fail to register.
A tensor over an anonymous mapping of its own never shares a page, and is exactly its size
rounded up to a page (PyTorch's pinned allocator rounds to a power of two instead).
"""
from __future__ import annotations

import math
import mmap

import torch


def page_aligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised (zero-filled by the kernel) host tensor over pages of its own; the mapping
    lives as long as the tensor (torch.frombuffer keeps it)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous and private, as malloc maps a large block
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
