"""Mechanism tests of incremental detokenization and stop-string matching (no processes)."""

import pytest

from engine.tokenizer import CharTokenizer
from openai_api.textstream import Detokenizer, StopMatcher

TOK = CharTokenizer(8192)


class Utf8Bytes:
    """A byte-level tokenizer, as byte-level BPE checkpoints are: it splits a multi-byte
    character across tokens, which the detokenizer must hold back until it is whole."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


BYTES = Utf8Bytes()


def stream(ids, chunk=1, tok=TOK):
    d = Detokenizer(tok)
    parts = [d.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return parts, d.flush()


def test_detokenizer_concatenation_equals_decode():
    for tok, ids in ((TOK, TOK.encode("héllo €uro 中文") + [300, 257, 1000, 256, 65, 258, 8191]),
                     (BYTES, list("héllo €uro".encode()) + [65])):
        for chunk in (1, 2, 3):
            parts, tail = stream(ids, chunk, tok)
            assert "".join(parts) + tail == tok.decode(ids)


def test_every_tiny_id_is_one_character_that_encodes_back_to_it():
    """So a peer that counts tokens by re-encoding the text counts what usage says."""
    ids = [i for i in range(TOK.vocab_size) if i not in (TOK.BOS, TOK.EOS)]
    assert all(len(TOK.decode([i])) == 1 for i in ids)
    assert TOK.encode(TOK.decode(ids)) == ids
    parts, tail = stream(ids, 7)
    assert "".join(parts) + tail == TOK.decode(ids)


def test_detokenizer_holds_back_split_utf8_character():
    euro = list("€".encode())  # 3 bytes, 3 tokens
    d = Detokenizer(BYTES)
    assert d.push(euro[:1]) == "" and d.push(euro[1:2]) == ""
    assert d.push(euro[2:]) == "€"


def test_detokenizer_flushes_incomplete_tail():
    parts, tail = stream([65, 0xE2, 0x82], tok=BYTES)
    assert "".join(parts) == "A" and tail == "\ufffd"


def feed_all(stops, deltas):
    m = StopMatcher(stops)
    out = []
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            return "".join(out), True, out
    return "".join(out) + m.flush(), False, out


def test_stop_string_across_deltas_ends_exactly_before_it():
    text, stopped, _ = feed_all(["lo w"], list("hello world"))
    assert stopped and text == "hel"


def test_stop_prefix_is_held_back_then_released():
    text, stopped, parts = feed_all(["abc"], list("xabxabd"))
    assert not stopped and text == "xabxabd"
    # Nothing that could start "abc" is emitted before the next delta decides it.
    assert parts == ["x", "", "", "abx", "", "", "abd"]


def test_earliest_of_several_stops_wins():
    text, stopped, _ = feed_all(["world", "o w"], ["hello wor", "ld"])
    assert stopped and text == "hell"


def test_stop_inside_one_delta():
    m = StopMatcher(["\n\n"])
    assert m.feed("para one\n\npara two") == ("para one", True)


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""


def test_empty_stop_string_refused():
    with pytest.raises(ValueError):
        StopMatcher(["", "x"])
