"""The K2 architecture served end to end: ``tidekv up --model tiny-k2`` as a user runs it, with a
client that knows the public API only through gRPC reflection (``reflection_client``).

tiny-k2 is all attention (DeepSeek-V3: MLA with RoPE, no KDA state), so every block boundary is
a reusable prefix: a prompt sharing 190 tokens with an earlier one reuses all 5 of its full
32-token blocks (the hybrid rule, with a snapshot every 4 blocks, would stop at 4). Shown here:
token-exact output against ``engine.generate`` (greedy and seeded sampling, batched), that
reuse across the two prefill workers (pulled from the holder), and a decode worker SIGKILLed
mid-stream with the stream going on token-exact on the other one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import engine
from deploy.cluster_state import read_state
from tests.e2e.helpers import prompt
from tests.e2e.reflection_client import ReflectionClient, fold

ROOT = Path(__file__).resolve().parents[2]
BLOCK = engine.DEFAULT_BLOCK_SIZE  # tidekv up's workers use the default block size
SNAPSHOT_INTERVAL = 4  # and the default snapshot interval, which this model has no use for
KILL_AFTER_TOKENS = 3


def _start_up(data_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--model", "tiny-k2", "--prefill", "2",
                             "--decode", "2", "--policy", "round_robin", "--data-dir", str(data_dir), "--port", "0",
                             "--http-port", "-1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line, until = "", time.monotonic() + 240
    while time.monotonic() < until and "tidekv cluster ready" not in line:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read()
    match = re.search(r"endpoint (\S+)", line)
    assert match, line
    return proc, match.group(1)


def _pid(data_dir: Path, name: str) -> int:
    return next(p.pid for p in read_state(data_dir / "state.json").processes if p.name == name)


def _wait_idle(data_dir: Path, timeout_s: float = 60.0) -> None:
    """Until the registry, as the cluster's state file lists it, shows every worker holding no
    request's pages (prefill workers count their idle device-tier blocks as free)."""
    until = time.monotonic() + timeout_s
    while True:
        workers = read_state(data_dir / "state.json").workers
        if len(workers) == 4 and all(w.num_free_pages == w.num_pages_total and not w.num_running for w in workers):
            return
        assert time.monotonic() < until, f"workers still hold requests: {workers}"
        time.sleep(0.5)


def test_up_tiny_k2_token_exact_reuse_across_workers_and_decode_migration(tmp_path):
    reference = engine.load_model("tiny-k2")
    assert not reference.cfg.cache_layout.has_state
    data = tmp_path / "data"
    proc, endpoint = _start_up(data)
    client = ReflectionClient(endpoint)
    try:
        assert "tidekv.v1.Inference" in client.services
        # 1. Token-exact, batched: greedy and seeded sampling, prompts from 5 tokens to several blocks.
        sampling = [{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 17}, {"temperature": 1.2, "seed": 3}]
        cases = [(prompt(n, i), 10 + i, sampling[i % 3]) for i, n in enumerate([5, 33, 77, 140, 64])]
        with ThreadPoolExecutor(len(cases)) as pool:
            outs = list(pool.map(lambda c: client.generate(client.request(c[0], c[1], **c[2])), cases))
        for (ids, n, s), out in zip(cases, outs, strict=True):
            assert out["finish_reasons"] == ["FINISH_REASON_LENGTH"], out["error"]
            assert out["token_ids"] == engine.generate(reference, ids, n, **s)
        assert {o["prefill_worker"] for o in outs} == {"prefill-0", "prefill-1"}
        assert {o["decode_workers"][0] for o in outs} == {"decode-0", "decode-1"}

        # 2. Prefix reuse across the two prefill workers: the second prompt goes to the other one
        # (round robin), which pulls every full block of the shared part from the first.
        first = prompt(230, 100)
        second = first[:190] + prompt(50, 101)
        a = client.generate(client.request(first, 4))
        b = client.generate(client.request(second, 10))
        assert a["cached_tokens"] == 0 and a["prefill_worker"] != b["prefill_worker"]
        assert b["pulled_from"] == a["prefill_worker"]
        assert b["cached_tokens"] == 190 // BLOCK * BLOCK == 160
        assert b["cached_tokens"] % (SNAPSHOT_INTERVAL * BLOCK)  # not a snapshot point of the hybrid rule
        assert b["token_ids"] == engine.generate(reference, second, 10)
        _wait_idle(data)

        # 3. Decode worker lost mid-stream: SIGKILLed after the client has a few tokens; the
        # Conductor migrates the request (prompt + tokens sent) and the stream goes on exactly.
        ids = prompt(40, 1100)
        params = {"temperature": 0.7, "top_k": 50, "seed": 5}
        expected = engine.generate(reference, ids, 600, **params)
        msgs, killed = [], ""
        for msg in client.stream(client.request(ids, 600, **params)):
            msgs.append(msg)
            if not killed and sum(len(m.token_ids) for m in msgs) >= KILL_AFTER_TOKENS:
                killed = msgs[0].decode_worker
                os.kill(_pid(data, killed), signal.SIGKILL)
        assert killed, "the request ended before it was mid-stream"
        out = fold(msgs, client.finish_reason)
        assert out["finish_reasons"] == ["FINISH_REASON_LENGTH"], out["error"]
        assert msgs[-1].finish_reason and out["token_ids"] == expected
        assert len(out["decode_workers"]) == 2 and out["decode_workers"][1] != killed
        # The kill was real: `tidekv up` saw the process die and started it again.
        until = time.monotonic() + 60
        while not any(p.name == killed and p.restarts and "SIGKILL" in p.last_exit
                      for p in read_state(data / "state.json").processes):
            assert time.monotonic() < until, read_state(data / "state.json").processes
            time.sleep(0.5)
        _wait_idle(data)
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
