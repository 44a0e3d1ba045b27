"""Build Hugging Face checkpoints with real architectures and random weights, because nothing can be
downloaded from a model hub (DESIGN.md §9).

Contract: `make_model(arch, size, ...)` writes a directory laid out exactly like a downloaded checkpoint
(config.json, generation_config.json, model.safetensors or index + shards, tokenizer.json,
tokenizer_config.json) that transformers and HELM load unchanged; the same arguments always give
byte-identical files, and weights are streamed to disk one chunk at a time, never held whole in memory.

    python tools/make_model.py --arch qwen3 --size tiny --dtype fp32 --seed 0 --out /tmp/tiny-qwen3
    python tools/make_model.py --size qwen3-1.7b --out /tmp/qwen3-1.7b        # --arch defaults to family

The parts are in tools/checkpoint/ (configs, weights, safetensors, tokenizer); this is the
directory they make and the command line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path


if __package__ in (None, ""):  # run as a script: python tools/make_model.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.checkpoint import DTYPES, MakeModelError
from tools.checkpoint.configs import ARCHS, build_config, preset_names
from tools.checkpoint.shards import DEFAULT_SHARD_SIZE_BYTES, parse_size, write_json, write_weights
from tools.checkpoint.tokenizer import build_tokenizer, generation_config

# ----------------------------------------------------------------------------------------------
# The checkpoint directory

_OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json")
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors(\.tmp)?")


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise MakeModelError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.iterdir())
    if existing and not force:
        raise MakeModelError(f"--out {out} is not empty ({', '.join(existing[:5])}"
                             f"{', ...' if len(existing) > 5 else ''}); pass --force to overwrite")
    # With force, remove only what an earlier build wrote; other files are left alone.
    for name in _OUTPUT_FILES:  # config.json first: it marks a complete build
        (out / name).unlink(missing_ok=True)
        (out / f"{name}.tmp").unlink(missing_ok=True)
    for p in out.iterdir():
        if _SHARD_RE.fullmatch(p.name):
            p.unlink()


def make_model(arch: str | None, size: str, dtype: str = "bf16", seed: int = 0,
               out: str | os.PathLike | None = None,
               shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES, overrides: dict | None = None,
               *, force: bool = False, config_only: bool = False,
               progress: bool | None = None, jobs: int | None = None) -> Path:
    """Write a random-weight checkpoint of `arch` at `size` ('tiny' or a preset name) to `out`.

    arch may be None for a preset (its family is used). `overrides` patch config.json fields
    (e.g. {"num_hidden_layers": 1, "rope_scaling": None}). `config_only` writes everything except
    the weights (for planning real sizes). `progress` None shows progress on stderr for
    checkpoints of PROGRESS_MIN_BYTES or more. `jobs`: processes writing a sharded checkpoint's
    shards at once (default: one per CPU for checkpoints of 1 GB or more; the bytes are the same).
    config.json is written last, so a directory holding it is a complete checkpoint. Returns `out`
    as a Path.
    """
    if out is None:
        raise MakeModelError("out (the checkpoint directory) is required")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise MakeModelError(f"seed must be a non-negative integer, got {seed!r}")
    shard_size_bytes = parse_size(shard_size_bytes)
    config = build_config(arch, size, dtype, overrides)
    tokenizer_json, tokenizer_config = build_tokenizer(config)  # validates specials before writing
    out = Path(out)
    _prepare_out(out, force)
    if not config_only:
        write_weights(out, config, seed, dtype, shard_size_bytes, progress, jobs)
    tmp = out / "tokenizer.json.tmp"
    tmp.write_text(tokenizer_json + "\n")
    os.replace(tmp, out / "tokenizer.json")
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(out / "generation_config.json", generation_config(config))
    write_json(out / "config.json", config)
    return out


# ----------------------------------------------------------------------------------------------
# CLI


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"value of {key} is not JSON: {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make_model.py", description="Build a Hugging Face checkpoint with random weights.")
    parser.add_argument("--arch", choices=ARCHS,
                        help="model family (default for a preset: the preset's family)")
    parser.add_argument("--size", required=True,
                        help=f"'tiny' or a preset: {', '.join(preset_names())}")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weights' dtype (default bf16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--shard-size", default="2GB",
                        help="largest safetensors file, e.g. 2GB, 500MB (default 2GB)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes writing shards at once (default: one per CPU from 1 GB; same bytes)")
    parser.add_argument("--config-only", action="store_true",
                        help="write config, generation config and tokenizer but no weights")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        type=_parse_override, metavar="KEY=JSON",
                        help="patch a config.json field, e.g. --set num_hidden_layers=2")
    args = parser.parse_args(argv)
    try:
        out = make_model(args.arch, args.size, args.dtype, args.seed, args.out,
                         parse_size(args.shard_size), dict(args.overrides), force=args.force,
                         config_only=args.config_only, jobs=args.jobs)
    except MakeModelError as e:
        parser.error(str(e))  # exits 2 with the usage line and the message
    except OSError as e:
        print(f"make_model.py: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("make_model.py: interrupted (the checkpoint directory is incomplete)", file=sys.stderr)
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
