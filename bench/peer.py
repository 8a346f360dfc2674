"""aiperf (a peer benchmark client) against the HTTP front, offline, beside Tidekv's own client.

    python -m bench.peer --aiperf /path/to/venv/bin/aiperf [--requests 30] [--concurrency 2]

aiperf is not in the test install (about 90 packages, 1.2 GB in a fresh venv, and it pins
prometheus-client 0.23, older than Tidekv's 0.26): install it in a venv of its own
(``python3.11 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf==0.13.0``) and name
its executable. The run starts a local cluster with its HTTP front, writes the tiny model's
files (``engine.model_files``) and, interleaved in one run, streams the same shape of
requests (streamed completions, ``ignore_eos``, synthetic prompts of ``--input-tokens``,
``--output-tokens`` out, at ``--concurrency``) through:

- the baseline: Tidekv's own streaming client (httpx, SSE), timing TTFT and inter-token gaps;
- aiperf, with ``--tokenizer DIR`` and no network; its exported JSON gives TTFT and ITL, its
  error count and its own comparison of ``usage`` with its tokenizer's counts (completions,
  not chat: a chat's ``usage`` counts the rendered template, aiperf only the messages).

Prints JSON: both sides' TTFT and ITL (p50, p90), aiperf's errors and mismatches, and the
ratios aiperf / baseline (the same server, the same shapes: a ratio near 1 says the two clients
measure alike). Not asserted; the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def baseline(url: str, num: int, concurrency: int, input_tokens: int, output_tokens: int, seed: int) -> dict:
    """Tidekv's own client: ``num`` streamed chats, TTFT and inter-token gaps per request."""
    import random

    import httpx

    rng = random.Random(seed)
    words = ("tide", "keeps", "every", "finished", "block", "of", "cache", "so", "the", "next", "request")
    prompts = [" ".join(rng.choice(words) for _ in range(input_tokens // 5)) for _ in range(num)]

    def one(text: str) -> tuple[float, list[float], int]:
        body = {"model": "tiny", "prompt": text, "stream": True, "max_tokens": output_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        t0, last, ttft, gaps, usage = time.perf_counter(), 0.0, 0.0, [], 0
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
                if not ttft:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
        return ttft, gaps, usage

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {"requests": num, "ttft_ms": {"p50": _pct(ttfts, 50) * 1e3, "p90": _pct(ttfts, 90) * 1e3},
            "itl_ms": {"p50": _pct(gaps, 50) * 1e3, "p90": _pct(gaps, 90) * 1e3},
            "completion_tokens_all_equal_requested": all(r[2] == output_tokens for r in results)}


def run_aiperf(aiperf: str, url: str, files: Path, num: int, concurrency: int, input_tokens: int,
               output_tokens: int, out: Path) -> dict:
    cmd = [aiperf, "profile", "--model", "tiny", "--url", url.removesuffix("/v1"), "--endpoint-type", "completions",
           "--streaming", "--tokenizer", str(files), "--prompt-input-tokens-mean", str(input_tokens),
           "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(output_tokens),
           "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--request-count", str(num),
           "--concurrency", str(concurrency), "--warmup-request-count", "2", "--artifact-dir", str(out),
           "--ui-type", "none"]
    t0 = time.perf_counter()
    # Not HF_HUB_OFFLINE: aiperf 0.13 then looks a local path up in the hub's cache and fails.
    # Given a directory it reads only the directory (this host reaches no hub at all).
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    exported = sorted(out.rglob("profile_export_aiperf.json"))
    if proc.returncode != 0 or not exported:
        return {"returncode": proc.returncode, "log_tail": log[-3000:]}
    doc = json.loads(exported[-1].read_text())

    def stat(name: str) -> dict:
        m = doc.get(name) or {}
        return {"p50": m.get("p50"), "p90": m.get("p90"), "unit": m.get("unit")}

    errors = doc.get("error_request_count") or {}
    return {"returncode": 0, "wall_s": time.perf_counter() - t0, "ttft": stat("time_to_first_token"),
            "itl": stat("inter_token_latency"), "requests": (doc.get("request_count") or {}).get("avg"),
            "errors": errors.get("avg", 0) if isinstance(errors, dict) else errors,
            # aiperf's own comparison of usage with its tokenizer's counts (the chat template applied)
            "usage_discrepancy_requests": (doc.get("usage_discrepancy_count") or {}).get("avg"),
            "usage_completion_tokens_diff_pct_max": (doc.get("usage_completion_tokens_diff_pct") or {}).get("max"),
            "usage_prompt_tokens_diff_pct_max": (doc.get("usage_prompt_tokens_diff_pct") or {}).get("max")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aiperf", required=True, help="the aiperf executable (its own venv)")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", default="", help="also write the JSON here")
    a = p.parse_args(argv)
    from deploy.local import ClusterConfig, LocalCluster
    from engine.model_files import model_files_dir

    work = Path(tempfile.mkdtemp(prefix="tidekv-peer-"))
    files = model_files_dir("tiny", work)
    config = ClusterConfig(policy="cache_aware", http_port=0, prefill_args=("--num-pages", "2048"),
                           decode_args=("--num-pages", "2048"))
    with LocalCluster(config) as cluster:
        base = baseline(cluster.http_url, a.requests, a.concurrency, a.input_tokens, a.output_tokens, 1)
        peer = run_aiperf(a.aiperf, cluster.http_url, files, a.requests, a.concurrency, a.input_tokens,
                          a.output_tokens, work / "aiperf")
        again = baseline(cluster.http_url, a.requests, a.concurrency, a.input_tokens, a.output_tokens, 2)
    shutil.rmtree(work, ignore_errors=True)
    ratios = {}
    if peer.get("returncode") == 0:
        b_ttft = statistics.mean([base["ttft_ms"]["p50"], again["ttft_ms"]["p50"]])
        b_itl = statistics.mean([base["itl_ms"]["p50"], again["itl_ms"]["p50"]])
        ratios = {"ttft_p50": (peer["ttft"]["p50"] or float("nan")) / b_ttft,
                  "itl_p50": (peer["itl"]["p50"] or float("nan")) / b_itl}
    report = {"machine": "shared 2-core development host", "shape": vars(a) | {"aiperf": Path(a.aiperf).name},
              "baseline_before": base, "aiperf": peer, "baseline_after": again,
              "aiperf_over_baseline": ratios}
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if peer.get("returncode") == 0 and not peer.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
