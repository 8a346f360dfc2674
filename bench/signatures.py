"""What body- and audience-bound signatures (``runtime.signatures``) cost the Conductor:
routing decisions per second with the internal calls of each decision signed and verified,
against the same loop in the same process with the same calls unsigned.

One decision is what the live Conductor does for one request, less the model: the decision
(``ConductorCore.route`` for bench.conductor's 1,000-block prompt on 8 + 8 workers, memory
index, ``mooncake``, keys given) and the four internal calls the gRPC dispatcher then makes,
with the bodies it builds (``Reserve`` to a decode worker; ``Prefill`` with the prompt's
16,001 token ids and 1,000 block keys, about 42 KB; ``Decode`` streaming one message;
``Release``), to stub workers that answer at once, in another process on 127.0.0.1 (so this
process is the Conductor side only, as in a cluster). Arms:

- ``signed``: the Conductor's channels (``Member.channel`` with the workers' session keys and
  audiences) and the workers' own interceptors (``WorkerCredential.interceptor`` with the
  real ``NEEDS`` of each role), as in a cluster;
- ``signing_only``: the Conductor signs, the stub workers do not verify: what signatures cost
  the Conductor itself (in a cluster the workers verify on their own cores);
- ``unsigned``: plain channels, servers without interceptors (the baseline).

Rounds rotate the order so drift lands on every arm alike; each arm's ``decisions_per_s`` is
the median, min and max over rounds. ``cpu_us_per_decision`` is the Conductor side's CPU time
per decision (this process, all threads), which other processes on a shared machine change
far less than wall time. ``ratio_over_unsigned`` gives, per arm, the ratio of the medians and
the per-round ratios, of decisions per second and of CPU throughput (1 / CPU per decision).
``sign_verify_us`` is the CPU cost of ``sign`` plus ``verify`` alone for a small
body, the Prefill body and a 440 KB heartbeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.conductor import BLOCK, FINGERPRINT, PROMPT, make_cluster, make_core, seed
from conductor.core import RequestFacts
from conductor.routing import RouteDecision
from decode_worker.server import NEEDS as DECODE_NEEDS
from kvstore.blocks import chain_keys
from prefill_worker.server import NEEDS as PREFILL_NEEDS
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import CONDUCTOR, Member, Nonces, WorkerCredential, sign, verify, worker_principal
from runtime.grpc_server import channel, start_server

SECRET = b"bench-signatures" * 4
# arm -> (the Conductor signs, the workers verify)
ARMS = {"signed": (True, True), "signing_only": (True, False), "unsigned": (False, False)}


class StubPrefill(igrpc.PrefillServicer):
    def Prefill(self, request, context):
        return ipb.PrefillResponse(first_token=7, cached_tokens=len(request.block_keys))


class StubDecode(igrpc.DecodeServicer):
    def Reserve(self, request, context):
        return ipb.ReserveResponse(transfer_address="tcp://127.0.0.1:9")

    def Decode(self, request, context):
        yield ipb.DecodeResponse(token_ids=[request.first_token], finish_reason=pb.FINISH_REASON_LENGTH)

    def Release(self, request, context):
        return ipb.ReleaseResponse(released=True)


INSTANCE = "i" * 32


def credential(role: str) -> WorkerCredential:
    return WorkerCredential(Member(SECRET, worker_principal(f"{role}-0")), f"{role}-0", INSTANCE)


def serve_stubs(signed: bool) -> None:
    """A process's body: the stub prefill and decode workers (``signed``: with the workers'
    interceptors), their addresses printed as one line, served until stdin closes."""
    needs = {"prefill": PREFILL_NEEDS, "decode": DECODE_NEEDS}
    adds = {"prefill": lambda s: igrpc.add_PrefillServicer_to_server(StubPrefill(), s),
            "decode": lambda s: igrpc.add_DecodeServicer_to_server(StubDecode(), s)}
    servers = []
    for role in ("prefill", "decode"):
        interceptors = [credential(role).interceptor(needs[role])] if signed else []
        servers.append(start_server([adds[role]], [f"tidekv.v1.{role.title()}"], max_workers=4,
                                    interceptors=interceptors))
    print(" ".join(s.address for s in servers), flush=True)
    sys.stdin.read()
    for s in servers:
        s.stop(0)


class Arm:
    """The stub workers in their own process (``verify``: with interceptors), and the
    Conductor's stubs dialling them (``sign``: signed channels)."""

    def __init__(self, sign: bool, verify: bool):
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.signatures", "--serve-stubs",
                                      "signed" if verify else "unsigned"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        prefill, decode = self.proc.stdout.readline().split()
        conductor, creds = Member(SECRET, CONDUCTOR), {"prefill": credential("prefill"), "decode": credential("decode")}
        self.channels = [conductor.channel(addr, creds[role].session_key, audience=creds[role].member.principal)
                         if sign else channel(addr) for role, addr in (("prefill", prefill), ("decode", decode))]
        self.prefill, self.decode = igrpc.PrefillStub(self.channels[0]), igrpc.DecodeStub(self.channels[1])

    def calls(self, request_id: str, keys: tuple[bytes, ...]) -> None:
        """The dispatcher's four calls for one routed request."""
        self.decode.Reserve(ipb.ReserveRequest(request_id=request_id, prompt_tokens=len(PROMPT), max_tokens=8,
                                               deadline_s=60.0), timeout=10)
        self.prefill.Prefill(ipb.PrefillRequest(request_id=request_id, token_ids=PROMPT, block_keys=keys,
                                                sampling=pb.SamplingParams(max_tokens=8),
                                                decode_transfer_address="tcp://127.0.0.1:9", deadline_s=60.0),
                             timeout=10)
        for _ in self.decode.Decode(ipb.DecodeRequest(request_id=request_id, first_token=7,
                                                      prompt_tokens=len(PROMPT)), timeout=10):
            pass
        self.decode.Release(ipb.ReleaseRequest(request_id=request_id), timeout=10)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _round(core, arm: Arm, keys: tuple[bytes, ...], seq: list[int], seconds: float) -> tuple[float, float]:
    """For ``seconds``: route, then the calls of the decision. (decisions per wall second, the
    Conductor side's CPU microseconds per decision: this process, every thread)."""
    n, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        seq[0] += 1
        facts = RequestFacts(f"r{seq[0]}", seq[0], (), 8, "", block_keys=keys, num_prompt_tokens=len(PROMPT))
        out = core.route(facts)
        assert isinstance(out.outcome, RouteDecision), out.outcome
        arm.calls(facts.request_id, keys)
        core.pending.finish(facts.request_id, 0.0)
        n += 1
    return n / (time.perf_counter() - t0), (time.process_time() - cpu0) / n * 1e6


def _sign_verify_us(body: bytes, repeats: int = 500) -> dict[str, float]:
    """CPU microseconds of one ``sign`` and of one ``verify`` of ``body``."""
    nonces, method, audience = Nonces(), "/tidekv.v1.Prefill/Prefill", worker_principal("prefill-0")
    t0 = time.process_time()
    signatures = [dict(sign(SECRET, CONDUCTOR, method, audience, body)) for _ in range(repeats)]
    t1 = time.process_time()
    for md in signatures:
        verify(md, method, body, audience, lambda p: SECRET, nonces)
    t2 = time.process_time()
    return {"sign": (t1 - t0) / repeats * 1e6, "verify": (t2 - t1) / repeats * 1e6}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def signature_cost(rounds: int, seconds: float) -> dict[str, Any]:
    keys = tuple(chain_keys(PROMPT, BLOCK, FINGERPRINT))
    cluster = make_cluster()
    seed(cluster, keys)
    core, seq = make_core(cluster, "mooncake", keys), [10_000]
    arms = {name: Arm(*how) for name, how in ARMS.items()}
    rates: dict[str, list[float]] = {name: [] for name in ARMS}
    cpu_us: dict[str, list[float]] = {name: [] for name in ARMS}
    try:
        for arm in arms.values():  # warm-up: connections made, code paths hot
            _round(core, arm, keys, seq, seconds)
        names = list(ARMS)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                rate, cpu = _round(core, arms[name], keys, seq, seconds)
                rates[name].append(rate)
                cpu_us[name].append(cpu)
    finally:
        for arm in arms.values():
            arm.close()
    prefill_body = ipb.PrefillRequest(request_id="r", token_ids=PROMPT, block_keys=keys).SerializeToString()
    heartbeat = ipb.HeartbeatRequest(worker_id="w", events=[ipb.BlockEvent(key=k, kind=1) for k in keys] * 20)
    small = ipb.ReserveRequest(request_id="r", prompt_tokens=100, max_tokens=8).SerializeToString()
    bodies = {f"reserve_bytes_{len(small)}": small,
              f"prefill_bytes_{len(prefill_body)}": prefill_body,
              f"heartbeat_bytes_{heartbeat.ByteSize()}": heartbeat.SerializeToString()}
    def ratios(name: str) -> dict[str, Any]:
        per_round = [a / b for a, b in zip(rates[name], rates["unsigned"], strict=True)]
        cpu = [b / a for a, b in zip(cpu_us[name], cpu_us["unsigned"], strict=True)]
        med = statistics.median
        return {"decisions_per_s": {"of_medians": med(rates[name]) / med(rates["unsigned"]),
                                    "per_round": spread(per_round)},
                "cpu_throughput": {"of_medians": med(cpu_us["unsigned"]) / med(cpu_us[name]),
                                   "per_round": spread(cpu)}}

    return {"decisions_per_s": {name: spread(v) for name, v in rates.items()},
            "cpu_us_per_decision": {name: spread(v) for name, v in cpu_us.items()},
            "ratio_over_unsigned": {name: ratios(name) for name in ARMS if name != "unsigned"},
            "sign_verify_us": {name: _sign_verify_us(body) for name, body in bodies.items()},
            "goal_ratio_at_least": 0.95,
            "setup": {"rounds": rounds, "round_s": seconds, "order": "rotating, one arm after another each round",
                      "decision": "mooncake route (1,000 blocks, 8+8 workers, memory index) + Reserve, Prefill "
                                  "(16,001 tokens, 1,000 keys), Decode (1 message), Release over loopback gRPC "
                                  "to in-process stub workers",
                      "cpu": "time.process_time of the Conductor side (this process; the stub workers run in "
                             "another) per decision: what other processes on a shared machine change least"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--round-s", type=float, default=1.0)
    p.add_argument("--serve-stubs", choices=("signed", "unsigned"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_stubs:
        serve_stubs(args.serve_stubs == "signed")
        return
    print(json.dumps(signature_cost(args.rounds, args.round_s), indent=2))


if __name__ == "__main__":
    main()
