"""Quantized checkpoint directories with Kimi's tokenizer, served end to end.

1. A K2-Thinking-style directory (DeepSeek-V3 architecture, INT4 routed experts in
   compressed-tensors' pack-quantized, two shards, ``tiktoken.model`` + ``tokenizer_config.json``
   with a Kimi-style chat template) under ``tidekv up --model DIR``, with a client that knows
   the public API only through gRPC reflection: token-exact against ``engine.generate`` (greedy,
   seeded, batched), a text prompt tokenized by the Conductor with tiktoken, prefix reuse pulled
   across the two prefill workers, a decode worker SIGKILLed mid-stream with the stream going
   on token-exact, and the HTTP front's chat completion through the model's chat template.
2. A Kimi-Linear hybrid with MXFP4 experts (K3's expert format) on a local cluster: token-exact,
   and the text it returns is the tokenizer's decoding of those tokens.

Everything is written by the test (weights seeded, quantized by compressed-tensors; the BPE
rank file trained on a small corpus).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

import engine
from conductor.client import Client
from deploy.cluster_state import read_state
from deploy.local import ClusterConfig, LocalCluster
from engine.config import tiny_config, tiny_k2_config
from engine.quant import INT4, MXFP4
from engine.tiktoken_tokenizer import TiktokenTokenizer
from openai_api.chat_template import load_chat_template
from tests.checkpoint_support import train_ranks, write_quantized_checkpoint, write_tiktoken_tokenizer
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt
from tests.e2e.reflection_client import ReflectionClient, fold

ROOT = Path(__file__).resolve().parents[2]
BLOCK = engine.DEFAULT_BLOCK_SIZE
KILL_AFTER_TOKENS = 3


def _checkpoint(directory: Path, cfg, fmt: str, num_shards: int) -> tuple[engine.HybridModel, TiktokenTokenizer]:
    """A quantized checkpoint whose vocabulary is its tokenizer's (ranks + 256 specials, as Kimi's)."""
    directory.mkdir()
    ranks = train_ranks()
    vocab = len(ranks) + 256
    cfg = dataclasses.replace(cfg, vocab_size=vocab, bos_token_id=len(ranks), eos_token_id=len(ranks) + 1,
                              name=directory.name)
    write_quantized_checkpoint(directory, cfg, fmt, num_shards=num_shards)
    assert write_tiktoken_tokenizer(directory, ranks) == vocab
    reference = engine.load_model(str(directory))
    assert isinstance(reference.tokenizer, TiktokenTokenizer)
    return reference, reference.tokenizer


def _start_up(model_dir: Path, data_dir: Path) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--model", str(model_dir), "--prefill", "2",
                             "--decode", "2", "--policy", "round_robin", "--data-dir", str(data_dir), "--port", "0",
                             "--http-port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line, until = "", time.monotonic() + 300
    while time.monotonic() < until and "tidekv cluster ready" not in line:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read()
    match = re.search(r"endpoint (\S+), OpenAI HTTP API (\S+)", line)
    assert match, line
    return proc, match.group(1), match.group(2)


def _pid(data_dir: Path, name: str) -> int:
    return next(p.pid for p in read_state(data_dir / "state.json").processes if p.name == name)


def _wait_idle(data_dir: Path, timeout_s: float = 60.0) -> None:
    until = time.monotonic() + timeout_s
    while True:
        workers = read_state(data_dir / "state.json").workers
        if len(workers) == 4 and all(w.num_free_pages == w.num_pages_total and not w.num_running for w in workers):
            return
        assert time.monotonic() < until, f"workers still hold requests: {workers}"
        time.sleep(0.5)


def _token_exact_batch(client: ReflectionClient, reference) -> None:
    sampling = [{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 17}, {"temperature": 1.2, "seed": 3}]
    cases = [(prompt(n, i), 10 + i, sampling[i % 3]) for i, n in enumerate([5, 33, 77, 140])]
    with ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda c: client.generate(client.request(c[0], c[1], **c[2])), cases))
    for (ids, n, s), out in zip(cases, outs, strict=True):
        assert out["finish_reasons"] == ["FINISH_REASON_LENGTH"], out["error"]
        assert out["token_ids"] == engine.generate(reference, ids, n, **s)
    assert {o["prefill_worker"] for o in outs} == {"prefill-0", "prefill-1"}


def _reuse_across_prefill_workers(client: ReflectionClient, reference, data: Path) -> None:
    first = prompt(230, 100)
    second = first[:190] + prompt(50, 101)
    a = client.generate(client.request(first, 4))
    b = client.generate(client.request(second, 10))
    assert a["cached_tokens"] == 0 and a["prefill_worker"] != b["prefill_worker"]
    assert b["pulled_from"] == a["prefill_worker"] and b["cached_tokens"] == 190 // BLOCK * BLOCK
    assert b["token_ids"] == engine.generate(reference, second, 10)
    _wait_idle(data)


def _decode_worker_lost(client: ReflectionClient, reference, data: Path) -> None:
    ids, params = prompt(40, 1100), {"temperature": 0.7, "top_k": 50, "seed": 5}
    expected = engine.generate(reference, ids, 300, **params)
    msgs, killed = [], ""
    for msg in client.stream(client.request(ids, 300, **params)):
        msgs.append(msg)
        if not killed and sum(len(m.token_ids) for m in msgs) >= KILL_AFTER_TOKENS:
            killed = msgs[0].decode_worker
            os.kill(_pid(data, killed), signal.SIGKILL)
    assert killed, "the request ended before it was mid-stream"
    out = fold(msgs, client.finish_reason)
    assert out["finish_reasons"] == ["FINISH_REASON_LENGTH"], out["error"]
    assert out["token_ids"] == expected and len(out["decode_workers"]) == 2 and out["decode_workers"][1] != killed
    _wait_idle(data)


def test_up_k2_thinking_int4_with_kimi_tokenizer(tmp_path):
    model_dir = tmp_path / "k2-thinking-tiny"
    reference, tok = _checkpoint(model_dir, tiny_k2_config(), INT4, num_shards=2)
    data = tmp_path / "data"
    proc, endpoint, http = _start_up(model_dir, data)
    client = ReflectionClient(endpoint)
    try:
        _token_exact_batch(client, reference)
        # A text prompt: the Conductor tokenizes it with the checkpoint's tiktoken files.
        text = "The prefill worker streams 2048 keys. 缓存命中时只算新的词元。"
        out = client.generate(client.request_text(text, 12, temperature=0.8, seed=9))
        want = engine.generate(reference, tok.encode(text), 12, temperature=0.8, seed=9)
        assert out["token_ids"] == want and out["text"] == tok.decode(want)
        _reuse_across_prefill_workers(client, reference, data)
        _decode_worker_lost(client, reference, data)
        # The HTTP front's chat: the model's chat template, tokenized with tiktoken, stopped at <|im_end|>.
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is a block?"}]
        ids = tok.encode(load_chat_template(str(model_dir)).render(messages))
        assert ids.count(tok.special["<|im_end|>"]) == 2
        http_client = openai.OpenAI(base_url=http, api_key="unused", max_retries=0, timeout=120)
        served = http_client.models.list().data[0].id
        chat = http_client.chat.completions.create(model=served, messages=messages, max_completion_tokens=16,
                                                   temperature=0)
        http_client.close()
        want = engine.generate(reference, ids, 16, stop_token_ids=(tok.eos_token_id,))
        assert chat.choices[0].token_ids == want and chat.choices[0].message.content == tok.decode(want)
        assert chat.usage.prompt_tokens == len(ids)
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]


def test_kimi_linear_with_mxfp4_experts_on_a_cluster(tmp_path):
    model_dir = tmp_path / "kimi-linear-mxfp4"
    reference, tok = _checkpoint(model_dir, tiny_config(), MXFP4, num_shards=1)
    config = ClusterConfig(num_prefill=1, num_decode=1, model=str(model_dir), prefill_args=WORKER_ARGS,
                           decode_args=DECODE_ARGS)
    with LocalCluster(config) as cluster:
        client = Client(cluster.endpoint)
        try:
            cases = [(prompt(60, 3), 12, {}), (prompt(97, 4), 10, {"temperature": 0.9, "top_p": 0.9, "seed": 23})]
            for ids, n, sampling in cases:
                out = client.generate(Client.request(ids, n, **sampling))
                want = engine.generate(reference, ids, n, **sampling)
                assert out.token_ids == want, out.error
                assert out.text == tok.decode(want)
        finally:
            client.close()
