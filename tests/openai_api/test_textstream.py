"""Mechanism tests of incremental detokenization and stop-string matching (no processes)."""

import pytest

from engine.tokenizer import ByteTokenizer
from openai_api.textstream import Detokenizer, StopMatcher

TOK = ByteTokenizer(8192)


def stream(ids, chunk=1):
    d = Detokenizer(TOK)
    parts = [d.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return parts, d.flush()


def test_detokenizer_concatenation_equals_decode():
    ids = list("héllo €uro".encode()) + [300, 257, 1000, 256, 65]
    for chunk in (1, 2, 3):
        parts, tail = stream(ids, chunk)
        assert "".join(parts) + tail == TOK.decode(ids)


def test_detokenizer_holds_back_split_utf8_character():
    euro = list("€".encode())  # 3 bytes, 3 tokens
    d = Detokenizer(TOK)
    assert d.push(euro[:1]) == "" and d.push(euro[1:2]) == ""
    assert d.push(euro[2:]) == "€"


def test_detokenizer_flushes_incomplete_tail():
    parts, tail = stream([65, 0xE2, 0x82])
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
