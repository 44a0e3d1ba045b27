"""safetensors files written the way Hugging Face shards them, one chunk of values at a time."""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import struct
import sys
import time
from pathlib import Path

import torch

from tools.checkpoint import DTYPES, MakeModelError
from tools.checkpoint.weights import TensorSpec, tensor_specs, value_chunks

DEFAULT_SHARD_SIZE_BYTES = 2 * 10**9  # "2GB", the Hugging Face default (GB = 10^9 bytes)
PROGRESS_MIN_BYTES = 256 * 2**20  # show progress on stderr for checkpoints at least this big
PROGRESS_EVERY_S = 2.0
PARALLEL_MIN_BYTES = 10**9  # by default, shards are written by several processes from this size on


# ----------------------------------------------------------------------------------------------
# safetensors writing


def parse_size(text: str | int) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, '123' -> 123 (Hugging Face units)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise MakeModelError(f"bad size {text!r}: expected e.g. 2GB, 500MB, 1GiB or bytes")
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
        value = int(float(m.group(1)) * scale)
    if value < 1:
        raise MakeModelError(f"shard size must be positive, got {text!r}")
    return value


def _plan_shards(specs: list[TensorSpec], itemsize: int,
                 shard_size_bytes: int) -> list[list[TensorSpec]]:
    """Hugging Face's rule: start a new shard when the next tensor would overflow this one."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and used + nbytes > shard_size_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += nbytes
    return shards


class _Progress:
    """Progress lines on stderr (for big checkpoints only), at most one every PROGRESS_EVERY_S."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.done, self.enabled = total_bytes, 0, enabled
        self.t0 = self.last = time.monotonic()

    def advance(self, nbytes: int, where: str) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last >= PROGRESS_EVERY_S or self.done == self.total):
            self.last = now
            print(f"make_model: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                  f"({100 * self.done / self.total:.0f}%) {where}, {now - self.t0:.1f} s",
                  file=sys.stderr, flush=True)


def _write_safetensors(path: Path, specs: list[TensorSpec], seed: int, dtype: str,
                       progress: _Progress, where: str) -> None:
    """Stream one safetensors file: header first (offsets are known from shapes), then each tensor
    chunk by chunk, so peak memory is one chunk, not one shard. Written to a temp name, then renamed."""
    torch_dtype, _, tag = DTYPES[dtype]
    itemsize = torch.tensor([], dtype=torch_dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        header[spec.name] = {"dtype": tag, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for spec in specs:
                for chunk in value_chunks(spec, seed, torch_dtype):
                    f.write(memoryview(chunk.view(torch.uint8).numpy()))
                    progress.advance(chunk.numel() * itemsize, where)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # no half-written file left behind (a full disk, an interrupt)
        raise
    os.replace(tmp, path)


def write_weights(out: Path, config: dict, seed: int, dtype: str, shard_size_bytes: int,
                  progress: bool | None, jobs: int | None = None) -> None:
    """The checkpoint's safetensors: one file, or shards and their index. A sharded checkpoint's
    shards are written by `jobs` processes at once (default: one per CPU from PARALLEL_MIN_BYTES
    on, else one): drawing the values is what takes the time (a Qwen3-8B's 8 billion, about 40 s
    on one core), and each tensor's values depend only on the seed and its name, so the files are
    the same bytes however many write them."""
    specs = tensor_specs(config)
    itemsize = torch.tensor([], dtype=DTYPES[dtype][0]).element_size()
    total_bytes = sum(s.numel for s in specs) * itemsize
    shards = _plan_shards(specs, itemsize, shard_size_bytes)
    show = total_bytes >= PROGRESS_MIN_BYTES if progress is None else progress
    prog = _Progress(total_bytes, show)
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", specs, seed, dtype, prog, "model.safetensors")
        return
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    if jobs is None:  # a process costs a second or two to start: worth it for big checkpoints only
        jobs = (os.cpu_count() or 1) if total_bytes >= PARALLEL_MIN_BYTES else 1
    jobs = min(len(shards), jobs)
    if jobs > 1:
        _write_shards_at_once(out, names, shards, seed, dtype, itemsize, prog, jobs)
    else:
        for i, (name, shard) in enumerate(zip(names, shards), 1):
            _write_safetensors(out / name, shard, seed, dtype, prog, f"shard {i}/{len(shards)}")
    weight_map = {spec.name: name for name, shard in zip(names, shards) for spec in shard}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


def _write_shard(path: Path, specs: list[TensorSpec], seed: int, dtype: str) -> None:
    """A worker's shard (its progress is the parent's: one line a shard)."""
    torch.set_num_threads(1)  # one process a core: the draw is sequential, the affine map need not fan out
    _write_safetensors(path, specs, seed, dtype, _Progress(1, False), path.name)


def _write_shards_at_once(out: Path, names: list[str], shards: list[list[TensorSpec]], seed: int, dtype: str,
                          itemsize: int, progress: _Progress, jobs: int) -> None:
    """Every shard by its own process, `jobs` at a time (spawned: a forked child of a process whose
    OpenMP threads ran can hang in its first parallel region). A writer that fails or is killed
    (the OOM killer) stops the others at once, and no half-written file stays."""
    context = multiprocessing.get_context("spawn")
    pending = list(enumerate(zip(names, shards), 1))
    running: dict = {}  # process → (shard number, file name, specs)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                i, (name, shard) = pending.pop(0)
                writer = context.Process(target=_write_shard, args=(out / name, shard, seed, dtype), daemon=True)
                writer.start()
                running[writer] = (i, name, shard)
            ended = multiprocessing.connection.wait([w.sentinel for w in running])
            for writer in [w for w in running if w.sentinel in ended]:
                writer.join()
                i, name, shard = running.pop(writer)
                if writer.exitcode != 0:
                    how = (f"was killed by signal {-writer.exitcode}" if writer.exitcode < 0
                           else f"exited with {writer.exitcode} (its error is above)")
                    raise MakeModelError(f"writing shard {i}/{len(shards)} ({name}) failed: its process {how}")
                progress.advance(sum(spec.numel for spec in shard) * itemsize,
                                 f"shard {i}/{len(shards)} ({jobs} at once)")
    except BaseException:
        for writer in running:
            writer.terminate()
        for writer in running:
            writer.join()
        for name in names:
            with contextlib.suppress(OSError):
                (out / f"{name}.tmp").unlink(missing_ok=True)
        raise


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
