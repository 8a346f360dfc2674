"""What security and fault tolerance cost, on live local clusters (127.0.0.1). Prints one JSON object.

1. TLS + API keys: the same requests against two 1 prefill + 1 decode clusters up side by
   side, one serving every gRPC port over TLS with API keys on the public endpoint
   (``ClusterConfig(tls=True, api_keys=...)``), one with neither (``--insecure-no-auth``).
   Both sign every internal RPC with the cluster secret (``runtime.auth``; always on, so it
   is in both arms and this does not measure it). Rounds alternate the order (A B, B A, ...)
   to cancel drift; each round has fresh prompts, sent one at a time to each cluster (cold on
   both). TTFT p50 and ITL p50/p99, pooled and per round, and their ratios (on / off).
2. Decode-worker loss: 1 prefill + 2 decode workers, supervised (the killed worker comes
   back before the next repeat). A long greedy request is streamed and its decode worker
   SIGKILLed once ``KILL_AFTER_TOKENS`` tokens have arrived; the gap between the last token
   before the loss and the first after it, and the total time, against an undisturbed run of
   the same request (the same prompt under another tenant, so both are cold). Medians over
   repeats with fresh prompts; both runs' tokens are compared.
3. Body- and audience-bound signatures: routing decisions per second, each decision with the
   four internal calls a routed request makes, signed and verified against the same loop
   unsigned, and the Conductor's CPU per decision (``bench/signatures.py`` says how).
4. Encrypted KV transfer (what ``--tls`` turns on for tcp transfer links): ``bench.transfer``'s
   two-process sample (64 MiB of one layer's rows in 64 KiB or 16 MiB chunks into a receiver
   child's pages) over an authenticated tcp link, plaintext (``tcp-auth``) and AES-256-GCM
   (``tcp-encrypted``), in alternating rounds in the same run; per size the medians, the
   ratio encrypted / plaintext per round (median, min, max) and the goal (0.7).

Usage: python -m bench.security [--quick] [--rounds 8] [--per-round 6] [--repeats 7]
       [--only tls_and_auth,decode_loss,signatures,transfer_encryption]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from conductor.apikeys import add_key
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from deploy.supervision import RestartPolicy
from proto import inference_pb2 as pb

BLOCK = 16
WORKER_ARGS = ("--block-size", str(BLOCK), "--snapshot-interval-blocks", "2", "--num-pages", "1024")
DECODE_ARGS = ("--block-size", str(BLOCK), "--num-pages", "2048")
KILL_AFTER_TOKENS = 8
DEADLINE_S = 120.0


def log(msg: str) -> None:
    print(f"[security] {msg}", file=sys.stderr, flush=True)


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 131 + salt * 7919) % 250 + 1 for i in range(n)]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass
class Run:
    """One streamed request: when each token arrived (s after the call), the ids, the decode
    workers the stream named and how it ended."""

    times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    decode_workers: list[str] = field(default_factory=list)
    finish: str = ""
    error: str = ""
    total_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.times_s[0]

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times_s, self.times_s[1:], strict=False)]


def stream(client: Client, ids: list[int], max_tokens: int, tenant: str = "", on_token=None) -> Run:
    """Streams one greedy request; ``on_token(run)`` after each message with tokens."""
    run = Run()
    t0 = time.perf_counter()
    try:
        for msg in client.stub.Generate(Client.request(ids, max_tokens=max_tokens, tenant=tenant), timeout=DEADLINE_S):
            now = time.perf_counter() - t0
            if msg.decode_worker:
                run.decode_workers.append(msg.decode_worker)
            run.times_s.extend([now] * len(msg.token_ids))
            run.token_ids.extend(msg.token_ids)
            if msg.finish_reason:
                run.finish, run.error = pb.FinishReason.Name(msg.finish_reason), msg.error
            if msg.token_ids and on_token is not None:
                on_token(run)
    except grpc.RpcError as e:
        run.error = f"{e.code().name}: {e.details()}"
    run.total_s = time.perf_counter() - t0
    return run


def arm_figures(runs: list[Run]) -> dict[str, float]:
    runs = [r for r in runs if r.times_s]  # a failed one (listed apart) has no latency
    itl = [g for r in runs for g in r.itl_s]
    return {"ttft_p50_s": statistics.median(r.ttft_s for r in runs), "itl_p50_s": pct(itl, 0.5),
            "itl_p99_s": pct(itl, 0.99), "num_requests": len(runs), "num_gaps": len(itl)}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def tls_and_auth_cost(work: Path, rounds: int, per_round: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    keys = work / "apikeys.json"
    key = add_key(str(keys), tenant="bench")
    common = dict(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS)
    secure = LocalCluster(ClusterConfig(tls=True, api_keys=str(keys), data_dir=str(work / "secure"), **common))
    plain = LocalCluster(ClusterConfig(data_dir=str(work / "plain"), **common))
    arms: dict[str, list[list[Run]]] = {"on": [], "off": []}
    try:
        log("starting a TLS + API key cluster and a plain one")
        secure.start()
        plain.start()
        clients = {"on": Client(secure.endpoint, api_key=key, tls_ca=secure.tls.ca), "off": Client(plain.endpoint)}
        try:
            keyless = Client(secure.endpoint, tls_ca=secure.tls.ca)
            refused = stream(keyless, prompt(16, 1), 2).error
            keyless.close()
            for client in clients.values():  # warm-up, not recorded
                for i in range(2):
                    stream(client, prompt(prompt_len, 90 + i), max_tokens)
            for r in range(rounds):
                order = ("on", "off") if r % 2 == 0 else ("off", "on")
                prompts = [prompt(prompt_len, 100 + r * per_round + i) for i in range(per_round)]
                for name in order:
                    arms[name].append([stream(clients[name], ids, max_tokens) for ids in prompts])
                log(f"round {r + 1}/{rounds} ({' '.join(order)}), load {os.getloadavg()[0]:.2f}")
        finally:
            for c in clients.values():
                c.close()
    finally:
        secure.stop()
        plain.stop()
    out = compare_arms(arms)
    out["failed"] = [r.error or f"{len(r.token_ids)} tokens" for rs in arms.values() for rnd in rs for r in rnd
                     if r.error or len(r.token_ids) != max_tokens]
    out["without_key_refused_with"] = refused.split(":")[0]
    out["setup"] = {"rounds": rounds, "requests_per_round": per_round, "prompt_tokens": prompt_len,
                    "max_tokens": max_tokens, "order": "alternating: on off, off on, ...",
                    "on": "TLS on every gRPC port + API key (Bearer) on the public endpoint",
                    "off": "plaintext, --insecure-no-auth",
                    "both": "internal RPCs signed with the cluster secret (always on)", "goal_overhead": 0.05}
    return out


def compare_arms(arms: dict[str, list[list[Run]]]) -> dict[str, Any]:
    """Pooled figures per arm, their ratios, and per-round figures and ratios (median, min, max)."""
    pooled = {name: arm_figures([r for rnd in rs for r in rnd]) for name, rs in arms.items()}
    by_round = {name: [arm_figures(rnd) for rnd in rs] for name, rs in arms.items()}
    out: dict[str, Any] = {"on": pooled["on"], "off": pooled["off"], "ratio_on_over_off": {}, "per_round": {}}
    for metric in ("ttft_p50_s", "itl_p50_s", "itl_p99_s"):
        out["ratio_on_over_off"][metric] = pooled["on"][metric] / pooled["off"][metric]
        ratios = [a[metric] / b[metric] for a, b in zip(by_round["on"], by_round["off"], strict=True)]
        out["per_round"][metric] = {"on": spread([f[metric] for f in by_round["on"]]),
                                    "off": spread([f[metric] for f in by_round["off"]]), "ratio": spread(ratios)}
    return out


def wait_back(cluster: LocalCluster, worker_id: str, old_address: str) -> float:
    """Until ``worker_id`` is registered from a new address (its restarted process); seconds waited."""
    t0 = time.monotonic()
    while {w.worker_id: w.rpc_address for w in cluster.workers().workers}.get(worker_id) in (None, old_address):
        if time.monotonic() - t0 > DEADLINE_S:
            raise RuntimeError(f"{worker_id} did not come back within {DEADLINE_S:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - t0


def killed_run(cluster: LocalCluster, client: Client, ids: list[int], max_tokens: int, tenant: str
               ) -> tuple[Run, int, str]:
    """The request streamed with its decode worker SIGKILLed (a crash) after ``KILL_AFTER_TOKENS``
    tokens: the run, how many tokens had arrived at the kill, and the worker killed."""
    at: list[int] = []
    victim: list[str] = []

    def kill(run: Run) -> None:
        if not at and len(run.token_ids) >= KILL_AFTER_TOKENS:
            victim.append(run.decode_workers[0])
            cluster.procs[victim[0]].kill()
            at.append(len(run.token_ids))

    run = stream(client, ids, max_tokens, tenant, on_token=kill)
    return run, (at or [0])[0], (victim or [""])[0]


def one_repeat(cluster: LocalCluster, client: Client, i: int, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """The request killed and undisturbed (under two tenants: both cold), in alternating order."""
    if i % 2 == 0:
        base = stream(client, ids, max_tokens, tenant=f"base-{i}")
        cut, at, victim = killed_run(cluster, client, ids, max_tokens, tenant=f"kill-{i}")
    else:
        cut, at, victim = killed_run(cluster, client, ids, max_tokens, tenant=f"kill-{i}")
        base = stream(client, ids, max_tokens, tenant=f"base-{i}")
    row: dict[str, Any] = {"victim": victim, "killed_after_tokens": at, "moved_to": cut.decode_workers[1:],
                           "error": cut.error or base.error,
                           "token_exact": cut.token_ids == base.token_ids and len(base.token_ids) == max_tokens}
    if at and len(cut.times_s) > at:
        row["gap_s"] = cut.times_s[at] - cut.times_s[at - 1]
        row["undisturbed_itl_p50_s"] = pct(base.itl_s, 0.5)
        row["extra_gap_s"] = row["gap_s"] - row["undisturbed_itl_p50_s"]
        row["total_s"], row["undisturbed_total_s"] = cut.total_s, base.total_s
        row["lost_s"] = cut.total_s - base.total_s
    return row


def migration_cost(work: Path, repeats: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    config = ClusterConfig(num_prefill=1, num_decode=2, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS,
                           supervise=True, data_dir=str(work / "migration"),
                           restart_policy=RestartPolicy(initial_backoff_s=0.5, max_backoff_s=2.0, max_restarts=100))
    rows: list[dict[str, Any]] = []
    log("starting a supervised 1 prefill + 2 decode cluster")
    with LocalCluster(config) as cluster:
        client = Client(cluster.endpoint)
        try:
            stream(client, prompt(prompt_len, 7), max_tokens)  # warm-up
            for i in range(repeats):
                addresses = {w.worker_id: w.rpc_address for w in cluster.workers().workers}
                row = one_repeat(cluster, client, i, prompt(prompt_len, 5000 + i), max_tokens)
                rows.append(row)
                log(f"repeat {i + 1}/{repeats}: {json.dumps(row)}")
                if row["victim"]:
                    row["back_after_s"] = wait_back(cluster, row["victim"], addresses[row["victim"]])
            migrations = cluster.conductor_counter("decode_migrations")
        finally:
            client.close()
    done = [r for r in rows if "gap_s" in r]
    out: dict[str, Any] = {"repeats": rows, "decode_migrations_total": migrations}
    for metric in ("gap_s", "undisturbed_itl_p50_s", "extra_gap_s", "total_s", "undisturbed_total_s", "lost_s"):
        if done:
            out[metric] = spread([r[metric] for r in done])
    out["all_token_exact"] = bool(rows) and all(r["token_exact"] for r in rows)
    out["setup"] = {"prompt_tokens": prompt_len, "max_tokens": max_tokens, "kill_after_tokens": KILL_AFTER_TOKENS,
                    "cluster": "1 prefill + 2 decode, supervised", "kill": "SIGKILL of the stream's decode worker"}
    return out


def transfer_encryption_cost(rounds: int, repeats: int, mib: int) -> dict[str, Any]:
    """Section 3 of the module docstring: plaintext against encrypted tcp, rounds alternating."""
    from bench.transfer import SIZES_BYTES, bench_backend

    sizes = {name: SIZES_BYTES[name] for name in ("64KiB", "16MiB")}
    arms: dict[str, list[dict]] = {"tcp-auth": [], "tcp-encrypted": []}
    for r in range(rounds):
        order = ("tcp-auth", "tcp-encrypted") if r % 2 == 0 else ("tcp-encrypted", "tcp-auth")
        for arm in order:
            arms[arm].append(bench_backend(arm, repeats, mib << 20, sizes))
        log(f"transfer round {r + 1}/{rounds} ({' '.join(order)}), load {os.getloadavg()[0]:.2f}")
    out: dict[str, Any] = {}
    for size in sizes:
        plain = [row[size]["median_gbps"] for row in arms["tcp-auth"]]
        sealed = [row[size]["median_gbps"] for row in arms["tcp-encrypted"]]
        ratio = statistics.median(a / b for a, b in zip(sealed, plain, strict=True))
        out[size] = {"plaintext_gbps": spread(plain), "encrypted_gbps": spread(sealed),
                     "ratio_encrypted_over_plaintext": spread([a / b for a, b in zip(sealed, plain, strict=True)]),
                     "goal": 0.7, "met": ratio >= 0.7}
    out["setup"] = {"rounds": rounds, "samples_per_round": repeats, "bytes_per_sample": mib << 20,
                    "order": "alternating: plaintext encrypted, encrypted plaintext, ...",
                    "plaintext": "tcp, authenticated handshake, CRC-32 per frame",
                    "encrypted": "tcp, authenticated handshake, AES-256-GCM per frame (the tag replaces the CRC)"}
    return out


SECTIONS = ("tls_and_auth", "decode_loss", "signatures", "transfer_encryption")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--per-round", type=int, default=6)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    args = p.parse_args()
    rounds, per_round, repeats = (2, 3, 2) if args.quick else (args.rounds, args.per_round, args.repeats)
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        p.error(f"--only: unknown sections {sorted(only - set(SECTIONS))}; known: {SECTIONS}")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-security-") as tmp:
        work = Path(tmp)
        if "tls_and_auth" in only:
            out["tls_and_auth"] = tls_and_auth_cost(work, rounds, per_round, prompt_len=256, max_tokens=32)
        if "decode_loss" in only:
            out["decode_loss"] = migration_cost(work, repeats, prompt_len=64, max_tokens=200)
        if "signatures" in only:
            from bench.signatures import signature_cost

            log("signatures: routing decisions with signed and unsigned internal calls")
            out["signatures"] = signature_cost(rounds=4 if args.quick else 16, seconds=0.5 if args.quick else 1.0)
        if "transfer_encryption" in only:
            out["transfer_encryption"] = transfer_encryption_cost(rounds, 3 if args.quick else 5, mib=64)
        out["machine"] = {"cpus": os.cpu_count(), "load_1m_at_end": os.getloadavg()[0]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
