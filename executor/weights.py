"""Streaming reads of a safetensors checkpoint (single file or sharded with an index).

Tensors are read one at a time from memory-mapped files, so loading a stage costs the stage's
own weights plus one tensor in flight, never the whole model first. Every problem with the
files (missing, corrupt, a tensor absent or mis-shaped) raises WeightsError naming it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from executor.errors import WeightsError


class CheckpointReader:
    """Name → tensor access over the safetensors files of a checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._handles: dict[Path, object] = {}
        self._where = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.model_dir / "model.safetensors.index.json"
        single = self.model_dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"{index} is not a valid safetensors index: {e!r}") from None
            return {name: self.model_dir / fname for name, fname in weight_map.items()}
        if single.is_file():
            return {name: single for name in self._open(single).keys()}
        raise WeightsError(
            f"no weights in {self.model_dir}: expected model.safetensors or model.safetensors.index.json"
        )

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            if not path.is_file():
                raise WeightsError(f"weight shard {path.name} named by the index is missing from {self.model_dir}")
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise WeightsError(f"cannot read {path}: {e}") from None
            self._handles[path] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Read one tensor, check its shape, convert to dtype and move it to device."""
        path = self._where.get(name)
        if path is None:
            raise WeightsError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        try:
            tensor = self._open(path).get_tensor(name)
        except WeightsError:
            raise
        except Exception as e:
            raise WeightsError(f"cannot read tensor {name!r} from {path.name}: {e}") from None
        if tuple(tensor.shape) != tuple(shape):
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies {tuple(shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise WeightsError(f"tensor {name!r} has non-float dtype {tensor.dtype}")
        return tensor.to(device=device, dtype=dtype)

    def close(self) -> None:
        self._handles.clear()
