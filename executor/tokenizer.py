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

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special_tokens, those the tokenizer's post-processor adds (a
        BOS for Llama and Mistral, none for Qwen), as transformers' tokenizer(text) does."""
        return self._tok.encode(text, add_special_tokens=special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class IncrementalDecoder:
    """Feed token ids one at a time; get back only the newly completed text.

    Decodes a short window (from the last emitted boundary) rather than the whole output, so
    streaming stays O(1) per token however long the generation. Text that ends in the middle of a
    UTF-8 character is held back until the character completes, but never more than MAX_HELD ids:
    a character is at most 4 bytes, so bytes that have not made one by then never will (a model
    can emit any byte tokens), and are sent as U+FFFD, all but the last few ids, which may still
    begin one. `flush` gives what is held when the generation ends.
    """

    MAX_HELD = 8  # ids held back for an incomplete character
    MAY_BEGIN = 3  # ... of which these last ones are kept when the rest are sent as they are

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here have been emitted as text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._emit(len(self._ids))
        if text is None and len(self._ids) - self._read >= self.MAX_HELD:
            text = self._emit(len(self._ids) - self.MAY_BEGIN, complete=False)
        return text or ""

    def flush(self) -> str:
        """What is still held back (an incomplete character's bytes, as U+FFFD); '' if nothing."""
        return self._emit(len(self._ids), complete=False) or ""

    def _emit(self, end: int, complete: bool = True) -> str | None:
        """The text of ids [read, end) if it adds any (and, where `complete`, ends in a whole
        character), the window moved past them; else None."""
        if end <= self._read:
            return None
        done = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:end])
        if len(text) <= len(done) or (complete and text.endswith("\ufffd")):
            return None  # nothing new, or an incomplete UTF-8 sequence: wait for the next token
        self._prefix, self._read = self._read, end
        return text[len(done):]
