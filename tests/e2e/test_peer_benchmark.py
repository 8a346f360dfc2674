"""A peer benchmark client, guidellm, against ``tidekv up``'s HTTP front, offline: it loads the
tokenizer from the directory ``tidekv up`` prints (``model files: DIR``), streams chat
completions with ``ignore_eos`` at concurrency 2, and every request succeeds with every output
token asked for (its text re-encodes to as many, less any special token generated) and a prompt
count equal to what the tokenizer counts in the templated prompt. guidellm is in the test extras; aiperf, whose
install is heavier and pins an older prometheus-client, runs in ``bench/peer.py`` instead."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM = shutil.which("guidellm", path=str(Path(sys.executable).parent))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
NUM_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 32, 16

pytestmark = pytest.mark.skipif(GUIDELLM is None, reason="guidellm is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """``tidekv up`` as a user runs it (cache_aware: no calibration), with a HOME of its own."""
    home = tmp_path_factory.mktemp("home")
    data = tmp_path_factory.mktemp("up")
    http_port = free_port()
    env = {**os.environ, **OFFLINE, "HOME": str(home), "TIDEKV_TORCH_THREADS": "1"}
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--policy", "cache_aware", "--port", str(free_port()),
           "--http-port", str(http_port), "--data-dir", str(data)]
    err = open(data / "up.err", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        ready = proc.stdout.readline()
        assert "tidekv cluster ready" in ready, ready + (data / "up.err").read_text()[-3000:]
        until = time.monotonic() + 60  # printed to stderr right after the ready line
        while not (files := re.search(r"^model files: (\S+)", (data / "up.err").read_text(), re.M)):
            assert time.monotonic() < until and proc.poll() is None, (data / "up.err").read_text()[-3000:]
            time.sleep(0.2)
        yield f"http://127.0.0.1:{http_port}", Path(files.group(1)), home
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()


def test_guidellm_runs_offline_with_zero_errors_and_matching_token_counts(up, tmp_path):
    url, model_files, home = up
    out = tmp_path / "guidellm.json"
    cmd = [GUIDELLM, "run", "--backend", f"kind=openai_http,target={url},model=tiny",
           "--tokenizer", f"kind=huggingface_auto,model={model_files}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    run = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **OFFLINE, "HOME": str(home)}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert requests["errored"] == [] and requests["incomplete"] == [], requests["errored"][:1]
    done = requests["successful"]
    assert len(done) >= NUM_REQUESTS - 2, len(done)  # the profile may count warm-up requests apart

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_files), local_files_only=True)
    for r in done:
        body = json.loads(r["request_args"])["body"]
        assert body["ignore_eos"] is True and body["stream"] is True
        # The output's usage (what guidellm reports) is every token asked for (ignore_eos).
        # Re-encoded, the text counts every generated token but the special ones (BOS, EOS:
        # with ignore_eos the tiny model's random weights do generate them, and their text is
        # empty, as with vLLM's skip_special_tokens), one character each: at most the usage.
        assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, r["output_metrics"]
        assert 0 < len(tok.encode(r["output"], add_special_tokens=False)) <= OUTPUT_TOKENS, r["output"]
        # The prompt's usage is what the tokenizer counts in the templated prompt.
        messages = [{"role": m["role"], "content": "".join(p["text"] for p in m["content"])} for m in body["messages"]]
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert r["input_metrics"]["text_tokens"] == len(tok.encode(prompt, add_special_tokens=False))
    print(f"guidellm: {len(done)} requests, 0 errors, output tokens {OUTPUT_TOKENS} each")
