"""Overhead of the OpenAI HTTP front vs gRPC ``Generate`` on the same cluster and prompts.

One local cluster (Conductor + 1 prefill + 1 decode) and one HTTP front process before it
(``python -m openai_api``). Every repeat sends the same number of streamed requests down each
path, interleaved (gRPC, HTTP, gRPC, ...) so that drift in machine load hits both alike, each
with a fresh prompt of the same length (nothing is reused from the cache) and the same
``max_tokens`` (greedy; the HTTP requests set ``ignore_eos`` so both paths stream every token):

- TTFT: request sent -> first token-bearing message (gRPC) / SSE chunk (HTTP), client side;
- ITL: the gaps between token-bearing messages / chunks from the second decode token on (the
  first gap also holds the KV hand-off, which is TTFT's business), divided by the tokens
  the later one carries (a chunk carries more than one only when text was held back).

The front's own CPU time per streamed token (from /proc) is reported too: on a machine whose
cores the cluster shares, that is what the front takes from the workers.

Per repeat: TTFT p50, ITL p50 and p99 for each path and the overhead (HTTP % over gRPC for
TTFT, also paired: the median over back-to-back gRPC/HTTP request pairs, which drift disturbs
least; ms added per token for ITL); the JSON reports the median and min/max of those over the
repeats. Goals (issue 12): under 5% added to TTFT, under 1 ms added per token. Not asserted.
Usage: python -m bench.http [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.common import process_cpu_s as common_process_cpu_s
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster, free_port

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 32
SETTLE_S = 0.3  # before each timed request: the prefill worker stores and publishes blocks after answering
GOALS = {"ttft_p50_added_pct": 5.0, "itl_added_ms_per_token": 1.0}


def log(msg: str) -> None:
    print(f"[http] {msg}", file=sys.stderr, flush=True)


def ids(seed: int, n: int) -> list[int]:
    """n byte-range token ids, fixed by seed (a linear congruential sequence)."""
    x, out = seed * 2654435761 % (1 << 32), []
    for _ in range(n):
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(x % 250 + 1)
    return out


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@contextlib.contextmanager
def http_front(conductor: str) -> Iterator[tuple[str, int]]:
    """The HTTP front as its own process; yields (base URL, pid); SIGTERM (then SIGKILL) at the end."""
    port = free_port()
    env = {**os.environ, "TIDEKV_TORCH_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "openai_api", "--conductor", conductor, "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        until = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"http front did not become ready (exit code {proc.poll()})")
            time.sleep(0.1)
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), None elsewhere."""
    try:
        return common_process_cpu_s(pid)
    except OSError:
        return None


def itl_gaps(stamps: list[tuple[float, int]]) -> list[float]:
    """Per-token gaps from (time, tokens carried) of each token-bearing message, skipping the
    first token (prefill's) and the first gap (the KV hand-off)."""
    return [(b - a) / n for (a, _), (b, n) in zip(stamps[1:], stamps[2:], strict=False)]


def grpc_stream(client: Client, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    t0, stamps = time.perf_counter(), []
    for msg in client.stub.Generate(Client.request(prompt, max_tokens=max_tokens), timeout=600):
        if msg.token_ids:
            stamps.append((time.perf_counter(), len(msg.token_ids)))
        if msg.error:
            raise RuntimeError(f"gRPC stream failed: {msg.error}")
    assert sum(n for _, n in stamps) == max_tokens, "gRPC stream came short"
    return stamps[0][0] - t0, itl_gaps(stamps)


def http_stream(http: httpx.Client, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0, stamps = time.perf_counter(), []
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n = len(json.loads(line[6:])["choices"][0]["token_ids"])
                if n:
                    stamps.append((time.perf_counter(), n))
    assert sum(n for _, n in stamps) == max_tokens, "HTTP stream came short"
    return stamps[0][0] - t0, itl_gaps(stamps)


def spread(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def one_repeat(client: Client, http: httpx.Client, r: int, requests: int, prompt_len: int,
               max_tokens: int) -> dict[str, dict[str, float]]:
    samples = {p: {"ttft": [], "gaps": []} for p in ("grpc", "http")}
    for i in range(requests):
        for j, path in enumerate(("grpc", "http") if i % 2 == 0 else ("http", "grpc")):
            prompt = ids(10_000 * (r + 1) + 10 * i + j, prompt_len)
            time.sleep(SETTLE_S)
            ttft, gaps = (grpc_stream(client, prompt, max_tokens) if path == "grpc"
                          else http_stream(http, prompt, max_tokens))
            samples[path]["ttft"].append(ttft)
            samples[path]["gaps"].extend(gaps)
    out = {p: {"ttft_p50_ms": pct(s["ttft"], 0.5) * 1e3, "itl_p50_ms": pct(s["gaps"], 0.5) * 1e3,
               "itl_p99_ms": pct(s["gaps"], 0.99) * 1e3} for p, s in samples.items()}
    # Request i of each path ran back to back: their difference is the least disturbed by drift.
    pairs = list(zip(samples["grpc"]["ttft"], samples["http"]["ttft"], strict=True))
    out["paired"] = {"ttft_added_ms": statistics.median(h - g for g, h in pairs) * 1e3,
                     "ttft_added_pct": statistics.median(100 * (h / g - 1) for g, h in pairs)}
    return out


def report(per_repeat: list[dict[str, dict[str, float]]]) -> dict:
    out: dict = {}
    for path in ("grpc", "http"):
        out[path] = {k: spread([rep[path][k] for rep in per_repeat]) for k in per_repeat[0][path]}
    ttft_pct = [100 * (rep["http"]["ttft_p50_ms"] / rep["grpc"]["ttft_p50_ms"] - 1) for rep in per_repeat]
    itl50 = [rep["http"]["itl_p50_ms"] - rep["grpc"]["itl_p50_ms"] for rep in per_repeat]
    itl99 = [rep["http"]["itl_p99_ms"] - rep["grpc"]["itl_p99_ms"] for rep in per_repeat]
    out["overhead"] = {"ttft_p50_added_pct": spread(ttft_pct, 1), "itl_p50_added_ms": spread(itl50, 3),
                       "itl_p99_added_ms": spread(itl99, 3),
                       "ttft_paired_added_ms": spread([rep["paired"]["ttft_added_ms"] for rep in per_repeat]),
                       "ttft_paired_added_pct": spread([rep["paired"]["ttft_added_pct"] for rep in per_repeat], 1)}
    med = {k: v["median"] for k, v in out["overhead"].items()}
    out["goals"] = GOALS
    out["meets_goals"] = (med["ttft_paired_added_pct"] <= GOALS["ttft_p50_added_pct"]
                          and med["itl_p50_added_ms"] <= GOALS["itl_added_ms_per_token"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats and requests")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    repeats, requests = (2, 2) if args.quick else (5, 6)
    t0, load_start = time.perf_counter(), os.getloadavg()
    cfg = ClusterConfig(num_prefill=1, num_decode=1, threads_per_process=1,
                        prefill_args=("--block-size", str(BLOCK_SIZE)), decode_args=("--block-size", str(BLOCK_SIZE)))
    log("starting the cluster and the HTTP front")
    with LocalCluster(cfg) as cluster, http_front(cluster.endpoint) as (base, front_pid):
        client = Client(cluster.endpoint)
        http = httpx.Client(base_url=base, timeout=600)
        try:
            one_repeat(client, http, 99, 1, args.prompt_len, 8)  # warm-up: connections, allocators
            per_repeat, cpu_start = [], process_cpu_s(front_pid)
            for r in range(repeats):
                per_repeat.append(one_repeat(client, http, r, requests, args.prompt_len, args.max_tokens))
                g, h = per_repeat[-1]["grpc"], per_repeat[-1]["http"]
                log(f"repeat {r}: TTFT p50 grpc {g['ttft_p50_ms']:.1f} ms http {h['ttft_p50_ms']:.1f} ms; "
                    f"ITL p50 {g['itl_p50_ms']:.2f} / {h['itl_p50_ms']:.2f} ms, "
                    f"p99 {g['itl_p99_ms']:.2f} / {h['itl_p99_ms']:.2f} ms; "
                    f"paired TTFT added {per_repeat[-1]['paired']['ttft_added_ms']:.1f} ms")
            cpu_end = process_cpu_s(front_pid)
        finally:
            http.close()
            client.close()
    num_http_tokens = repeats * requests * args.max_tokens
    front_cpu = None if cpu_start is None else round((cpu_end - cpu_start) / num_http_tokens * 1e3, 3)
    result = {
        "quick": args.quick, "cpu_count": os.cpu_count(), "repeats": repeats, "requests_per_path_per_repeat": requests,
        "prompt_tokens": args.prompt_len, "max_tokens": args.max_tokens, "block_size": BLOCK_SIZE,
        "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        **report(per_repeat), "front_cpu_ms_per_streamed_token": front_cpu,
        "wall_s": round(time.perf_counter() - t0, 1),
        "notes": (f"{os.cpu_count()} cores shared by the Conductor, both workers, the HTTP front and this client "
                  "(and whatever else runs here, see loadavg); figures are client-side, per streamed token."),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
