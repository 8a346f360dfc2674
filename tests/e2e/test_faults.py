"""Fault tolerance on real processes: a decode worker lost mid-stream (the request moves to
another decode worker and the client's stream goes on token-exact), a hung prefill worker
(SIGSTOP: the attempt is cancelled at its bound and retried elsewhere) and deadlines that
cannot be met (DEADLINE_EXCEEDED, never a FAILED terminal after some tokens), a decode
reservation that expires while its prefill is stopped (retried, token-exact), and a Conductor
killed with requests at the prefill worker (their reservations freed at once, not at the TTL).

Streams are made long (hundreds of tokens at milliseconds each) so that a worker killed
after the first few tokens the client reads is killed mid-stream; the tests assert where the
stream went on, never how long anything took."""

import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import engine
from conductor.client import Client, Completion
from deploy.local import ClusterConfig, LocalCluster
from observe.top import scrape
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import worker_principal
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS, make_cluster
from tests.e2e.helpers import prompt, run_all, wait_all_freed, worker_stats

KILL_AFTER_TOKENS = 3


def _tokens(msgs: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def _generate_and_kill(cluster, client: Client, req: pb.GenerateRequest) -> tuple[list[pb.GenerateResponse], str]:
    """Streams ``req``; SIGKILLs its decode worker (named by the first message) once the client
    has ``KILL_AFTER_TOKENS`` tokens. Returns every message and the killed worker."""
    msgs: list[pb.GenerateResponse] = []
    killed = ""
    for msg in client.stub.Generate(req, timeout=300):
        msgs.append(msg)
        if not killed and len(_tokens(msgs)) >= KILL_AFTER_TOKENS:
            killed = msgs[0].decode_worker
            cluster.procs[killed].kill()
    assert killed, "the request ended before it was mid-stream"
    assert cluster.procs[killed].wait(30) == -signal.SIGKILL
    return msgs, killed


def _wait_dropped(cluster, worker_id: str, timeout_s: float = 60.0) -> None:
    """Until the Conductor's registry no longer lists ``worker_id`` (it stopped heartbeating)."""
    until = time.monotonic() + timeout_s
    while worker_id in {w.worker_id for w in cluster.workers().workers}:
        assert time.monotonic() < until, f"{worker_id} is still registered"
        time.sleep(0.2)


def _check_stream(msgs: list[pb.GenerateResponse], expected: list[int], finish: int, num_prompt: int,
                  tokenizer) -> None:
    """One terminal message, the last; the tokens and text deltas of the uninterrupted run."""
    assert [m.finish_reason for m in msgs if m.finish_reason] == [finish]
    assert msgs[-1].finish_reason == finish
    assert _tokens(msgs) == expected
    assert "".join(m.text for m in msgs) == tokenizer.decode(expected)
    assert msgs[-1].usage.prompt_tokens == num_prompt and msgs[-1].usage.completion_tokens == len(expected)


def _conductor_counter(cluster, name: str) -> dict[str, float]:
    """A Conductor counter's samples by their ``reason`` label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels.get("reason", ""): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == f"tidekv:{name}_total"}


def test_a_lost_decode_worker_is_replaced_mid_stream_until_none_is_left(reference):
    """Three decode workers, each SIGKILLed under a streaming request in turn: the first two
    requests (greedy, then sampled with a stop token) go on on another decode worker, exactly
    as the single-process engine generates them; the third finds no decode worker left and
    ends FAILED, saying so, after correct tokens."""
    tokenizer = engine.load_tokenizer("tiny")
    with make_cluster(1, 3, policy="round_robin") as cluster:
        client = Client(cluster.endpoint)
        try:
            ids = prompt(40, 1100)
            msgs, killed = _generate_and_kill(cluster, client, Client.request(ids, max_tokens=600))
            _check_stream(msgs, engine.generate(reference, ids, 600), pb.FINISH_REASON_LENGTH, len(ids), tokenizer)
            moved = [m.decode_worker for m in msgs[1:] if m.decode_worker]
            assert len(moved) == 1 and moved[0] != killed
            assert _conductor_counter(cluster, "decode_migrations") == {"unavailable": 1.0}
            _wait_dropped(cluster, killed)

            # Sampled, with a stop token the reference meets late: honoured across the move.
            ids = prompt(50, 1200)
            sampling = dict(temperature=0.8, top_k=50, seed=11)
            full = engine.generate(reference, ids, 600, **sampling)
            stop_at = next(j for j in range(300, 600) if full.index(full[j]) == j)
            expected = engine.generate(reference, ids, 600, stop_token_ids=[full[stop_at]], **sampling)
            assert expected == full[: stop_at + 1]
            req = Client.request(ids, max_tokens=600, stop_token_ids=[full[stop_at]], **sampling)
            msgs, killed = _generate_and_kill(cluster, client, req)
            _check_stream(msgs, expected, pb.FINISH_REASON_STOP, len(ids), tokenizer)
            moved = [m.decode_worker for m in msgs[1:] if m.decode_worker]
            assert len(moved) == 1 and moved[0] != killed
            _wait_dropped(cluster, killed)

            ids = prompt(40, 1300)
            msgs, killed = _generate_and_kill(cluster, client, Client.request(ids, max_tokens=600))
            assert [m.finish_reason for m in msgs if m.finish_reason] == [pb.FINISH_REASON_FAILED]
            error = msgs[-1].error
            assert error.startswith(f"decode worker {killed} lost after") and "decode failed" in error
            assert "no other decode worker" in error or "no decode workers" in error, error
            sent = _tokens(msgs)
            assert KILL_AFTER_TOKENS <= len(sent) < 600 and sent == engine.generate(reference, ids, len(sent))
            _wait_dropped(cluster, killed)
            stats = wait_all_freed(cluster)  # the prefill worker's: each continuation's prefill was freed
            assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values())
        finally:
            client.close()


def test_a_hung_prefill_worker_is_cancelled_and_its_requests_retried_elsewhere(reference):
    """Two prefill workers, round robin, one SIGSTOPped (it stays registered: a long worker
    TTL). The requests routed to it are cancelled at the attempt's bound and complete on the
    other worker, token-exact; afterwards (SIGCONT) every worker's cache is free."""
    conductor_args = ("--prefill-timeout-s", "2", "--worker-ttl-s", "120")
    with make_cluster(2, 1, policy="round_robin", conductor_args=conductor_args) as cluster:
        stopped = cluster.procs["prefill-0"]
        stopped.send_signal(signal.SIGSTOP)
        try:
            prompts = [prompt(300, 1400 + i) for i in range(4)]
            out = run_all(cluster.endpoint, [Client.request(p, max_tokens=8) for p in prompts])
            retries = _conductor_counter(cluster, "prefill_retries")
        finally:
            stopped.send_signal(signal.SIGCONT)
        for p, c in zip(prompts, out, strict=True):
            assert (c.finish_reason, c.num_terminal, c.prefill_worker) == ("length", 1, "prefill-1"), c
            assert c.token_ids == engine.generate(reference, p, 8)
        assert retries == {"stalled": 2.0}  # round robin sent every other request to prefill-0
        stats = wait_all_freed(cluster)
        assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values())


def test_a_stopped_prefill_worker_is_given_up_when_its_heartbeats_stop(reference):
    """The same stopped worker under the default 60 s prefill timeout: its heartbeats stop, it
    leaves the registry within its lease (1.5 s here), and the calls in flight to it are given
    up then (STALLED) and retried on the other worker, token-exact, long before the timeout:
    each request's own deadline (30 s) would end it otherwise."""
    conductor_args = ("--worker-ttl-s", "1.5", "--heartbeat-interval-s", "0.25")
    with make_cluster(2, 1, policy="round_robin", conductor_args=conductor_args) as cluster:
        stopped = cluster.procs["prefill-0"]
        stopped.send_signal(signal.SIGSTOP)
        try:
            prompts = [prompt(300, 1500 + i) for i in range(4)]
            reqs = [Client.request(p, max_tokens=8) for p in prompts]
            for r in reqs:
                r.deadline_s = 30.0
            out = run_all(cluster.endpoint, reqs)
            retries = _conductor_counter(cluster, "prefill_retries")
            log = (cluster.log_dir / "conductor.log").read_text()
        finally:
            stopped.send_signal(signal.SIGCONT)
        for p, c in zip(prompts, out, strict=True):
            assert (c.finish_reason, c.num_terminal, c.prefill_worker) == ("length", 1, "prefill-1"), c
            assert c.token_ids == engine.generate(reference, p, 8)
        assert retries.get("stalled", 0) >= 1, retries
        assert "(stopped heartbeating)" in log and "given up: the worker stopped heartbeating" in log


@pytest.fixture(scope="module")
def long_cluster():
    with make_cluster(1, 1, conductor_args=("--max-new-tokens", "4000")) as c:
        yield c


@pytest.mark.parametrize("by", ["deadline_s", "client"])
def test_a_deadline_shorter_than_the_predicted_ttft_is_refused_at_once(long_cluster, by):
    req = Client.request(prompt(3000, 1500), max_tokens=4)
    timeout_s = 120.0
    if by == "deadline_s":
        req.deadline_s = 0.5
    else:
        timeout_s = 1.0
    client = Client(long_cluster.endpoint)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(client.stub.Generate(req, timeout=timeout_s))
    finally:
        client.close()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The Conductor's refusal (the client's own timer would say only "Deadline Exceeded").
    assert "predicted time to first token" in e.value.details() and by in e.value.details()


@pytest.mark.parametrize("by", ["deadline_s", "client"])
def test_a_deadline_passing_mid_stream_ends_the_call_with_deadline_exceeded(long_cluster, reference, by):
    ids = prompt(40, 1600)
    req = Client.request(ids, max_tokens=3900)
    timeout_s = 120.0
    if by == "deadline_s":
        req.deadline_s = 3.0
    else:
        timeout_s = 3.0
    client = Client(long_cluster.endpoint)
    msgs: list[pb.GenerateResponse] = []
    try:
        with pytest.raises(grpc.RpcError) as e:
            for msg in client.stub.Generate(req, timeout=timeout_s):
                msgs.append(msg)
    finally:
        client.close()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    if by == "deadline_s":  # no client timer: the Conductor ended it
        assert "deadline_s (3 s) passed" in e.value.details(), e.value.details()
    assert not any(m.finish_reason for m in msgs)
    sent = _tokens(msgs)
    assert 0 < len(sent) < 3900 and sent == engine.generate(reference, ids, len(sent))
    stats = wait_all_freed(long_cluster)
    assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values())


def test_a_hung_decode_worker_is_left_mid_stream(reference):
    """A decode worker SIGSTOPped under a streaming request sends nothing more: after
    --decode-stall-timeout-s the Conductor cancels the stream and continues the request on
    the other decode worker, token-exact, counted as a stalled migration."""
    tokenizer = engine.load_tokenizer("tiny")
    with make_cluster(1, 2, policy="round_robin", conductor_args=("--decode-stall-timeout-s", "2")) as cluster:
        client = Client(cluster.endpoint)
        stopped = None
        try:
            ids = prompt(40, 1500)
            msgs = []
            for msg in client.stub.Generate(Client.request(ids, max_tokens=600), timeout=300):
                msgs.append(msg)
                if stopped is None and len(_tokens(msgs)) >= KILL_AFTER_TOKENS:
                    stopped = cluster.procs[msgs[0].decode_worker]
                    stopped.send_signal(signal.SIGSTOP)
                    hung = msgs[0].decode_worker
            assert stopped is not None, "the request ended before it was mid-stream"
            _check_stream(msgs, engine.generate(reference, ids, 600), pb.FINISH_REASON_LENGTH, len(ids), tokenizer)
            moved = [m.decode_worker for m in msgs[1:] if m.decode_worker]
            assert len(moved) == 1 and moved[0] != hung
            assert _conductor_counter(cluster, "decode_migrations") == {"stalled": 1.0}
        finally:
            if stopped is not None:
                stopped.send_signal(signal.SIGCONT)
            client.close()


def _with_prefill_stopped(cluster, ids: list[int], while_stopped) -> Completion:
    """Sends ``ids`` (8 tokens) with prefill-0 SIGSTOPped; once the decode worker holds its
    reservation, calls ``while_stopped(held)`` (the decode worker's stats then), resumes the
    prefill worker whatever happened, and returns the completion."""
    stopped = cluster.procs["prefill-0"]
    stopped.send_signal(signal.SIGSTOP)
    client = Client(cluster.endpoint)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.generate, Client.request(ids, max_tokens=8))
            try:
                until = time.monotonic() + 60
                while True:
                    held = worker_stats(cluster, only="decode-0")["decode-0"]
                    if held.num_free_pages < held.num_pages_total:
                        break
                    assert time.monotonic() < until, "the request never reserved decode pages"
                    time.sleep(0.05)
                while_stopped(held)
            finally:
                stopped.send_signal(signal.SIGCONT)
            return pending.result(timeout=120)
    finally:
        client.close()


def _reservations_freed(metrics_address: str) -> dict[str, float]:
    """The decode worker's ``decode_reservations_freed_total`` by reason."""
    return {dict(labels)["reason"]: value for metric, labels, value in scrape(metrics_address, timeout_s=10)
            if metric == "tidekv:decode_reservations_freed_total"}


def test_a_reservation_expired_while_its_prefill_was_stopped_is_retried_token_exact(reference):
    """A decode reservation with a 1 s TTL, not renewed, whose prefill worker is SIGSTOPped: it
    expires (the decode worker frees its pages once its receiver has forgotten it); when the
    worker runs again, its KV finds no destination, that placement fails, and the retry
    completes the request token-exact (before, its KV landed in the freed pages and its Decode
    call found no reservation: the request failed after its first token). Nothing is left held."""
    config = ClusterConfig(num_prefill=1, num_decode=1, policy="round_robin", prefill_args=WORKER_ARGS,
                           decode_args=(*DECODE_ARGS, "--reservation-ttl-s", "1"),
                           conductor_args=("--reservation-renew-s", "0"))
    with LocalCluster(config) as cluster:
        def expired(held) -> None:
            until = time.monotonic() + 60
            while worker_stats(cluster, only="decode-0")["decode-0"].num_free_pages < held.num_pages_total:
                assert time.monotonic() < until, "the reservation never expired"
                time.sleep(0.05)

        p = prompt(200, 1700)
        c = _with_prefill_stopped(cluster, p, expired)
        # Its first placement failed at the KV push (no destination), before any token: retried.
        assert _conductor_counter(cluster, "prefill_retries") == {"transfer": 1.0}
        assert (c.finish_reason, c.num_terminal) == ("length", 1), c
        assert c.token_ids == engine.generate(reference, p, 8)
        stats = wait_all_freed(cluster)
        assert all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in stats.values())


def test_a_live_conductor_renews_a_reservation_past_its_ttl(reference):
    """The same stopped prefill worker under the default renewal: the reservation (0.4 s TTL)
    outlives the 1.5 s stop, several TTLs, because its live Conductor renews it; nothing
    expires, nothing is retried, and the request completes token-exact."""
    config = ClusterConfig(num_prefill=1, num_decode=1, policy="round_robin", prefill_args=WORKER_ARGS,
                           decode_args=(*DECODE_ARGS, "--reservation-ttl-s", "0.4"))
    with LocalCluster(config) as cluster:
        decode_metrics = next(w.metrics_address for w in cluster.workers().workers if w.worker_id == "decode-0")

        def still_held(_) -> None:
            time.sleep(1.5)  # under the worker's 3 s heartbeat TTL, so the Conductor does not give it up
            held = worker_stats(cluster, only="decode-0")["decode-0"]
            assert held.num_free_pages < held.num_pages_total, "the renewed reservation expired"

        p = prompt(200, 1750)
        c = _with_prefill_stopped(cluster, p, still_held)
        assert _conductor_counter(cluster, "prefill_retries") == {}
        assert (c.finish_reason, c.num_terminal) == ("length", 1), c
        assert c.token_ids == engine.generate(reference, p, 8)
        assert _reservations_freed(decode_metrics) == {"expired": 0.0, "transfer_failed": 0.0}


def test_a_dead_conductors_reservations_are_freed_by_the_prefill_workers_abort(reference):
    """The Conductor SIGKILLed while its requests are at the prefill worker (one prefilling,
    the rest queued) releases nothing; the prefill worker sees each call end, ABORTs each
    placement (the queued ones without doing their work) and the decode worker frees every
    reservation within seconds, not at its TTL (600 s here)."""
    num, prompt_tokens = 4, 6000
    config = ClusterConfig(num_prefill=1, num_decode=1, policy="round_robin", prefill_args=WORKER_ARGS,
                           decode_args=(*DECODE_ARGS, "--num-pages", "2048", "--reservation-ttl-s", "600"))
    with LocalCluster(config) as cluster:
        stubs, channels = {}, []  # asked directly: the Conductor, which lists the workers, is killed
        workers = cluster.workers().workers
        decode_metrics = next(w.metrics_address for w in workers if w.worker_id == "decode-0")
        for info in workers:
            ch = cluster.channel(info.rpc_address, worker_principal(info.worker_id))
            channels.append(ch)
            prefill = info.role == ipb.WORKER_ROLE_PREFILL
            stubs[info.worker_id] = igrpc.PrefillStub(ch) if prefill else igrpc.DecodeStub(ch)

        def stats() -> dict[str, ipb.WorkerStats]:
            return {w: stub.Stats(ipb.StatsRequest(), timeout=5) for w, stub in stubs.items()}

        client = Client(cluster.endpoint)
        # Seconds of prefill each on the tiny model: all four are reserved on the decode
        # worker long before the first prefill ends, so none is decoding at the kill.
        calls = [client.stub.Generate(Client.request(prompt(prompt_tokens, 1800 + i), max_tokens=8), timeout=120)
                 for i in range(num)]
        try:
            until = time.monotonic() + 60
            while True:
                now = stats()
                if now["decode-0"].num_live_requests == num and now["prefill-0"].num_live_requests == 1:
                    break
                assert time.monotonic() < until, f"the requests were never all placed: {now}"
                time.sleep(0.02)
            time.sleep(0.2)  # every Prefill call sent (each follows its Reserve at once)
            cluster.kill("conductor")
            until = time.monotonic() + 60
            while True:
                now = stats()
                if all(s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total for s in now.values()):
                    break
                assert time.monotonic() < until, f"a dead Conductor's requests still hold pages: {now}"
                time.sleep(0.1)
        finally:
            for call in calls:
                call.cancel()
            client.close()
            for ch in channels:
                ch.close()
        assert _reservations_freed(decode_metrics) == {"expired": 0.0, "transfer_failed": float(num)}
        log = (cluster.log_dir / "decode-0.log").read_text()
        # The one prefilling stopped at its next layer; the queued ones did none of their work.
        assert log.count("cancelled during prefill") == 1 and log.count("cancelled while queued") == num - 1, \
            log[-3000:]
