"""Text ↔ token ids with the checkpoint's own tokenizer.json, and incremental detokenization.

Streaming clients want text as tokens arrive, but one token may end in the middle of a UTF-8
character; `IncrementalDecoder` holds such bytes back until the character is complete.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from executor.errors import ConfigError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"no tokenizer.json in {model_dir}: pass token ids instead of text")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ConfigError(f"cannot load {path}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class IncrementalDecoder:
    """Feed token ids one at a time; get back only the newly completed text.

    Decodes a short window (from the last emitted boundary) rather than the whole output, so
    streaming stays O(1) per token however long the generation.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here have been emitted as text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        done = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""  # nothing new, or an incomplete UTF-8 sequence: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]
