"""Streamed text: held back while it could begin a stop string, cut before the stop string."""
import pytest

from executor.server.text import TextStream
from executor.tokenizer import IncrementalDecoder, Tokenizer


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


def test_characters_split_across_byte_tokens_stream_whole(tok):
    ids = tok.encode("héllo wörld 😀 日本語 €")
    assert max(tok.encode("😀")) < 256 and len(tok.encode("😀")) == 4  # one token a byte: split characters
    pieces, ts = stream_all(tok, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + ts.finish() == tok.decode(ids) == "héllo wörld 😀 日本語 €"


def test_bytes_that_never_make_a_character_are_sent_not_held(tok):
    """A model may emit byte tokens that are no UTF-8 (here 0xBC, a continuation byte, 3000
    times, then a whole character): they go out as U+FFFD once MAX_HELD are held, the decoder's
    window stays short (it was the whole run, decoded again at every token), and the character
    that follows still arrives whole."""
    decoded = []
    real_decode = tok.decode
    tok.decode = lambda ids: (decoded.append(len(ids)), real_decode(ids))[1]
    try:
        ids = [0xBC] * 3000 + tok.encode("é!")
        pieces, ts = stream_all(tok, ids)
    finally:
        del tok.decode
    sent = "".join(pieces)
    held = IncrementalDecoder.MAX_HELD
    assert sent.count("\ufffd") >= 3000 - held and sent.endswith("é!")
    assert max(decoded) <= 2 * held
    assert sent + ts.finish() == tok.decode(ids)


def test_finish_sends_the_bytes_of_a_character_that_never_completed(tok):
    ids = tok.encode("ab") + tok.encode("€")[:2]
    pieces, ts = stream_all(tok, ids)
    assert "".join(pieces) == "ab" and ts.finish() == "\ufffd" == tok.decode(ids)[2:]


def test_a_daemon_adds_the_tokenizers_special_tokens_unless_the_text_is_raw(checkpoint):
    """GenerateRequest.raw_text crosses the wire, and the daemon tokenizes as the offline CLI does:
    a Llama's BOS first, or nothing added for raw text."""
    from executor.pb import executor_pb2 as pb
    from executor.request_params import SamplingParams, StopCriteria
    from executor.server.daemon import Daemon
    from executor.server.messages import GenerateSpec

    path = checkpoint("llama", "fp32")
    daemon = Daemon(path, max_batch=1, max_queue=1)
    llama = Tokenizer(path)
    for raw in (False, True):
        spec = GenerateSpec(prompt_text="Once upon a time", prompt_ids=None, sampling=SamplingParams(),
                            stop=StopCriteria(), raw_text=raw)
        received = GenerateSpec.from_pb(pb.GenerateRequest.FromString(spec.to_pb(pb).SerializeToString()))
        assert received.raw_text == raw
        ids = daemon._prompt_ids(received)
        assert list(ids) == llama.encode("Once upon a time", special_tokens=not raw) and (ids[0] == 1000) != raw
    daemon.close()
