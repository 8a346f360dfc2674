"""Trace readers: the real Mooncake file, the generic JSONL/CSV schema round trip, bad lines."""

import json
from pathlib import Path

import pytest

from replay.traces import SYNTHETIC_TRACE, Trace, TraceRequest, read_trace, write_trace

SYNTHETIC = SYNTHETIC_TRACE


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_synthetic_mooncake_trace():
    trace = read_trace(SYNTHETIC)
    assert isinstance(trace, Trace) and trace.format == "mooncake" and trace.block_tokens == 512
    assert len(trace.requests) == 3993
    first = trace.requests[0]
    assert (first.index, first.arrival_s, first.input_len, first.output_len) == (0, 0.0, 40160, 6)
    assert first.hash_ids[:3] == (0, 1, 2) and len(first.hash_ids) == 79
    assert trace.requests[2].arrival_s == pytest.approx(0.040)
    assert all(len(r.hash_ids) == -(-r.input_len // 512) for r in trace.requests)


def test_mooncake_ms_to_seconds_and_extra_keys_ignored(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": 1500, "input_length": 513, "output_length": 0, "hash_ids": [4, 5], "extra": 1}, ""])
    (r,) = read_trace(path).requests
    assert r == TraceRequest(index=0, arrival_s=1.5, input_len=513, output_len=0, hash_ids=(4, 5))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_generic_round_trip(tmp_path, fmt):
    requests = (
        TraceRequest(0, 0.0, 700, 5, hash_ids=(1, 2)),
        TraceRequest(1, 0.25, 3, 2, prompt_ids=(10, 11, 12), tenant="acme", request_id="q1"),
        TraceRequest(2, 1.0 / 3.0, 512, 9, hash_ids=(1,), ttft_slo_s=0.5, tbt_slo_s=0.05),
    )
    path = tmp_path / f"t.{fmt}"
    write_trace(path, requests, fmt)
    trace = read_trace(path, fmt)
    assert trace.requests == requests and trace.format == fmt


def test_generic_block_tokens_parameter(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [{"arrival_s": 0, "output_length": 1, "input_length": 33,
                                               "hash_ids": [1, 2, 3]}])
    assert read_trace(path, "jsonl", block_tokens=16).requests[0].hash_ids == (1, 2, 3)
    write_lines(path, [{"arrival_s": 0, "output_length": 1, "input_length": 33, "hash_ids": [1, 2]}])
    with pytest.raises(ValueError, match=r"t.jsonl:1: field 'hash_ids'.*need ceil\(33/11\) = 3"):
        read_trace(path, "jsonl", block_tokens=11)


MOONCAKE_OK = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}


@pytest.mark.parametrize("bad, match", [
    ("{not json", r":2: not valid JSON"),
    ("[1, 2]", r":2: expected a JSON object"),
    ({**MOONCAKE_OK, "timestamp": -5}, r":2: field 'timestamp': expected a number >= 0, got -5"),
    ({**MOONCAKE_OK, "timestamp": "soon"}, r":2: field 'timestamp': expected a number"),
    ({**MOONCAKE_OK, "input_length": 0}, r":2: field 'input_length': expected an integer >= 1, got 0"),
    ({**MOONCAKE_OK, "input_length": 2.5}, r":2: field 'input_length': expected an integer"),
    ({k: v for k, v in MOONCAKE_OK.items() if k != "output_length"}, r":2: field 'output_length' is missing"),
    ({**MOONCAKE_OK, "hash_ids": [1, -2]}, r":2: field 'hash_ids': expected a list of integers >= 0"),
    ({**MOONCAKE_OK, "input_length": 1025}, r":2: field 'hash_ids': 1 ids cannot cover input_length 1025"),
])
def test_mooncake_bad_lines_name_line_and_field(tmp_path, bad, match):
    path = write_lines(tmp_path / "t.jsonl", [MOONCAKE_OK, bad, MOONCAKE_OK])
    with pytest.raises(ValueError, match=match):
        read_trace(path)


GENERIC_OK = {"arrival_s": 0.5, "output_length": 3, "input_length": 10, "hash_ids": [0]}


@pytest.mark.parametrize("bad, match", [
    ({**GENERIC_OK, "arrival": 1}, r":2: unknown field\(s\) \['arrival'\]"),
    ({"arrival_s": 0, "output_length": 3}, r":2: field 'input_length' is missing"),
    ({"arrival_s": 0, "output_length": 3, "input_length": 4}, r":2: field 'hash_ids' is missing"),
    ({**GENERIC_OK, "prompt_token_ids": [1]}, r":2: give prompt_token_ids OR input_length \+ hash_ids"),
    ({"arrival_s": 0, "output_length": 3, "prompt_token_ids": []}, r":2: field 'prompt_token_ids'"),
    ({**GENERIC_OK, "ttft_slo_s": 0}, r":2: field 'ttft_slo_s': expected a positive number"),
    ({**GENERIC_OK, "tenant": 7}, r":2: field 'tenant': expected a string"),
    ({**GENERIC_OK, "arrival_s": float("nan")}, r":2: field 'arrival_s': expected a finite number"),
])
def test_generic_jsonl_bad_lines(tmp_path, bad, match):
    path = write_lines(tmp_path / "t.jsonl", [GENERIC_OK, bad])
    with pytest.raises(ValueError, match=match):
        read_trace(path, "jsonl")


def test_generic_csv_bad_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,output_length,input_length,hash_ids\n0,1,10,0\n0.5,x,10,0\n")
    with pytest.raises(ValueError, match=r"t.csv:3: field 'output_length': expected an integer >= 0, got 'x'"):
        read_trace(path, "csv")
    path.write_text("arrival_s,output_length,input_length,hash_ids\n0,1,10,0 a\n")
    with pytest.raises(ValueError, match=r"t.csv:2: field 'hash_ids': expected space-separated integers"):
        read_trace(path, "csv")
    path.write_text("arrival_s,output_length,input_length,hash_ids\n0,1,10,0,9\n")
    with pytest.raises(ValueError, match=r"t.csv:2: more cells than header columns"):
        read_trace(path, "csv")


def test_empty_trace_and_unknown_format(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [""])
    with pytest.raises(ValueError, match="holds no requests"):
        read_trace(path)
    with pytest.raises(ValueError, match="trace format must be one of"):
        read_trace(path, "parquet")
