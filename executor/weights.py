"""Streaming reads of a safetensors checkpoint (single file or sharded with an index).

Each tensor is read with plain file reads straight into the memory of the stage that owns it
(for fused projections, into its rows of the fused matrix), one tensor at a time. Nothing is
memory-mapped: a mapping would keep every page it was read through in the process's RSS, so
fusing q/k/v and gate/up would hold their weights twice. Every problem with the files (missing,
corrupt, a tensor absent or mis-shaped) raises WeightsError naming it.

The format (github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
data, offsets relative to its start.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.errors import WeightsError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


class _Shard:
    """One .safetensors file: its parsed, checked header and an open file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = open(path, "rb", buffering=0)
        except OSError as e:
            raise WeightsError(f"cannot read {path}: {e}") from None
        try:
            self.entries = self._header()
        except WeightsError:
            self.file.close()
            raise

    def _header(self) -> dict[str, _Entry]:
        size = os.fstat(self.file.fileno()).st_size
        head = self.file.read(8)
        if len(head) < 8:
            raise WeightsError(f"cannot read {self.path}: {size} bytes is too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > min(_MAX_HEADER, size - 8):
            raise WeightsError(f"cannot read {self.path}: header of {n} bytes does not fit the {size}-byte file")
        try:
            raw = json.loads(self.file.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise WeightsError(f"cannot read {self.path}: header is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise WeightsError(f"cannot read {self.path}: header is not a JSON object")
        start, entries = 8 + n, {}
        for name, info in raw.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise WeightsError(f"cannot read {self.path}: bad header entry for {name!r} ({e!r})") from None
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != nbytes or start + end > size:
                raise WeightsError(f"cannot read {self.path}: tensor {name!r} ({info['dtype']} {list(shape)}) "
                                   f"has data offsets [{begin}, {end}] outside or inconsistent with the file")
            entries[name] = _Entry(dtype, shape, start + begin, nbytes)
        # As the safetensors library checks: the tensors tile the data exactly, so none reads
        # another's bytes (a damaged header could point two tensors at the same data)
        end = start
        for name, entry in sorted(entries.items(), key=lambda item: (item[1].offset, item[1].nbytes)):
            if entry.offset != end:
                raise WeightsError(f"cannot read {self.path}: tensor {name!r} starts at byte {entry.offset - start} of "
                                   f"the data, where the tensor before it ended at {end - start} (overlapping or "
                                   "missing bytes)")
            end += entry.nbytes
        if end != size:
            raise WeightsError(f"cannot read {self.path}: its tensors end at byte {end} of the {size}-byte file")
        return entries

    def read_into(self, entry: _Entry, out: torch.Tensor, name: str) -> None:
        """The tensor's bytes into `out` (contiguous CPU tensor of the entry's dtype and size)."""
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if entry.nbytes else memoryview(b"")
        done = 0
        while done < entry.nbytes:  # one read returns at most ~2 GiB
            got = os.preadv(self.file.fileno(), [view[done:]], entry.offset + done)
            if got <= 0:
                raise WeightsError(f"cannot read tensor {name!r} from {self.path.name}: file ended early")
            done += got

    def close(self) -> None:
        self.file.close()


def floating_dtype_of(model_dir: str | Path) -> torch.dtype | None:
    """The dtype of the checkpoint's first floating-point tensor by name, in its first shard by
    file name, from the header alone (as transformers picks a checkpoint's dtype: where norms are
    kept in fp32 beside bf16 linears, the first name, an embedding or a layer's linear, is bf16;
    in header order, which safetensors sorts by dtype, fp32 came first); None if it holds none."""
    reader = CheckpointReader(model_dir)
    try:
        shard = reader._open(min(set(reader._where.values())))
        for name in sorted(shard.entries):
            if shard.entries[name].dtype.is_floating_point:
                return shard.entries[name].dtype
        return None
    finally:
        reader.close()


class CheckpointReader:
    """Name → tensor access over the safetensors files of a checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._shards: dict[Path, _Shard] = {}
        self._where = self._index()
        self.read: set[str] = set()  # names of the tensors read so far

    def _index(self) -> dict[str, Path]:
        index = self.model_dir / "model.safetensors.index.json"
        single = self.model_dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"{index} is not a valid safetensors index: {e!r}") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()):
                raise WeightsError(f"{index} is not a valid safetensors index: its weight_map must map tensor "
                                   "names to file names in the checkpoint's directory")
            return {name: self.model_dir / fname for name, fname in weight_map.items()}
        if single.is_file():
            return {name: single for name in self._open(single).entries}
        raise WeightsError(
            f"no weights in {self.model_dir}: expected model.safetensors or model.safetensors.index.json"
        )

    def _open(self, path: Path) -> _Shard:
        shard = self._shards.get(path)
        if shard is None:
            if not path.is_file():
                raise WeightsError(f"weight shard {path.name} named by the index is missing from {self.model_dir}")
            shard = self._shards[path] = _Shard(path)
        return shard

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Read one tensor, check its shape, convert it to dtype on device. With `out` (a
        contiguous CPU tensor of that shape and dtype, e.g. rows of a fused matrix) it is read
        into `out`, with no copy when the file holds that dtype."""
        path = self._where.get(name)
        if path is None:
            raise WeightsError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        shard = self._open(path)
        entry = shard.entries.get(name)
        if entry is None:
            raise WeightsError(f"tensor {name!r} is not in {path.name}, though the index says so")
        if entry.shape != tuple(shape):
            raise WeightsError(f"tensor {name!r} has shape {entry.shape}, but config.json implies {tuple(shape)}")
        if not entry.dtype.is_floating_point:
            raise WeightsError(f"tensor {name!r} has non-float dtype {entry.dtype}")
        self.read.add(name)
        if out is not None and out.dtype == entry.dtype:
            shard.read_into(entry, out, name)
            return out
        raw = torch.empty(entry.shape, dtype=entry.dtype)
        shard.read_into(entry, raw, name)
        if out is not None:
            return out.copy_(raw)
        return raw.to(device=device, dtype=dtype)

    def same_bytes(self, a: str, b: str, chunk: int = 64 << 20) -> bool:
        """Whether tensors a and b hold the same dtype, shape and bytes (read a chunk at a time)."""
        ea, eb = (self._open(self._where[n]).entries.get(n) for n in (a, b))
        if ea is None or eb is None or (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
            return False
        sa, sb = self._open(self._where[a]), self._open(self._where[b])
        for at in range(0, ea.nbytes, chunk):
            n = min(chunk, ea.nbytes - at)
            if os.pread(sa.file.fileno(), n, ea.offset + at) != os.pread(sb.file.fileno(), n, eb.offset + at):
                return False
        return True

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()
