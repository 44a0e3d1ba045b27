"""Streamed text: held back while it could begin a stop string, cut before the stop string."""
import pytest

from executor.server.text import TextStream
from executor.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(checkpoint):
    return Tokenizer(checkpoint("qwen3", "fp32"))


def stream_all(tok, ids, stops=()):
    ts = TextStream(tok, stops)
    pieces = []
    for i in ids:
        pieces.append(ts.push(i))
        if ts.stopped_by:
            break
    return pieces, ts


def test_without_stop_strings_text_is_the_decoded_ids(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog")
    pieces, ts = stream_all(tok, ids)
    assert "".join(pieces) + ts.finish() == tok.decode(ids) and ts.stopped_by is None


def test_stop_string_across_tokens_cuts_the_text_before_it(tok):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    pieces, ts = stream_all(tok, ids, ("fox jum", "zebra"))
    assert ts.stopped_by == "fox jum"
    assert "".join(pieces) == "The quick brown "
    assert ts.finish() == "" and ts.push(ids[-1]) == ""  # nothing after the stop


def test_text_that_may_begin_a_stop_string_is_held_back(tok):
    ids = tok.encode("ab ab abc")
    ts = TextStream(tok, ("abd",))
    sent = "".join(ts.push(i) for i in ids)
    assert not sent.endswith("ab") and ts.stopped_by is None  # "ab" could still become "abd"
    assert sent + ts.finish() == "ab ab abc"


def test_without_a_tokenizer_there_is_no_text():
    ts = TextStream(None)
    assert ts.push(5) == "" and ts.finish() == ""
