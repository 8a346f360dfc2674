"""End-to-end serving through real processes: token-exact with the single-process engine,
prefix reuse (local and pulled), cancellation, bad input, admission under a flood, small
frames, and the shm transfer backend (one-copy writes into the decode worker's pages)."""

import threading

import grpc
import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from kvstore.hitrule import SnapshotPolicy
from tests.e2e.conftest import BLOCK, DECODE_ARGS, SNAP_EVERY, WORKER_ARGS, make_cluster
from tests.e2e.helpers import prompt, run_all, wait_all_freed

SAMPLING = [dict(), dict(temperature=0.8, top_p=0.9, top_k=40, seed=17), dict(temperature=1.2, seed=3)]


def check_exact(endpoint, reference, lengths, max_tokens=12):
    reqs, want = [], []
    for i, n in enumerate(lengths):
        ids, s = prompt(n, i), SAMPLING[i % len(SAMPLING)]
        reqs.append(Client.request(ids, max_tokens=max_tokens + i, **s))
        want.append(engine.generate(reference, ids, max_tokens + i, **s))
    outs = run_all(endpoint, reqs)
    for out, w in zip(outs, want, strict=True):
        assert out.num_terminal == 1 and out.finish_reason == "length", out.error
        assert out.token_ids == w
    return outs


def test_token_exact_1p1d(cluster_1x1, reference):
    check_exact(cluster_1x1.endpoint, reference, [5, 33, 77, 140, 16])
    wait_all_freed(cluster_1x1)


def test_token_exact_2p2d(cluster_2x2, reference):
    outs = check_exact(cluster_2x2.endpoint, reference, [9, 48, 64, 120, 31, 90])
    assert {o.prefill_worker for o in outs} == {"prefill-0", "prefill-1"}
    assert {o.decode_worker for o in outs} == {"decode-0", "decode-1"}


def expected_cached(first_len: int, shared: int, second_len: int) -> int:
    """Shared part rounded down to the last snapshot point of the first prompt (and leaving
    at least the last token of the second prompt to compute)."""
    points = SnapshotPolicy(SNAP_EVERY).snapshot_points(first_len // BLOCK)
    cap = min(shared // BLOCK, (second_len - 1) // BLOCK)
    usable = [p + 1 for p in points if p + 1 <= cap]
    return (usable[-1] if usable else 0) * BLOCK


def test_prefix_reuse_local(cluster_1x1, reference):
    first = prompt(230, 100)
    second = first[:190] + prompt(50, 101)  # 190 of 240 shared (79%)
    a = run_all(cluster_1x1.endpoint, [Client.request(first, max_tokens=4)])[0]
    b = run_all(cluster_1x1.endpoint, [Client.request(second, max_tokens=10)])[0]
    assert a.cached_tokens == 0
    assert b.cached_tokens == expected_cached(230, 190, 240) == 160
    assert b.token_ids == engine.generate(reference, second, 10)
    # Another tenant (cache salt) shares nothing.
    c = run_all(cluster_1x1.endpoint, [Client.request(second, max_tokens=3, tenant="other")])[0]
    assert c.cached_tokens == 0 and c.token_ids == b.token_ids[:3]


def test_prefix_pulled_from_other_worker(cluster_2x2, reference):
    first = prompt(260, 200)
    second = first[:224] + prompt(30, 201)  # 224 of 254 shared (88%)
    a = run_all(cluster_2x2.endpoint, [Client.request(first, max_tokens=3)])[0]
    b = run_all(cluster_2x2.endpoint, [Client.request(second, max_tokens=9)])[0]
    assert a.prefill_worker != b.prefill_worker  # round robin sends it to the other worker
    assert b.cached_tokens == expected_cached(260, 224, 254) == 224
    assert b.token_ids == engine.generate(reference, second, 9)


@pytest.mark.parametrize("field,kwargs,msg", [
    ("prompt", dict(prompt=[]), "token_ids: empty"),
    ("too long", dict(prompt=[1] * 8100), "the limit is"),
    ("max_tokens", dict(prompt=[1, 2], max_tokens=0), "sampling.max_tokens must be in"),
    ("max_tokens high", dict(prompt=[1, 2], max_tokens=100000), "sampling.max_tokens must be in"),
    ("temperature", dict(prompt=[1, 2], temperature=-1.0), "sampling.temperature"),
    ("top_p", dict(prompt=[1, 2], top_p=1.5), "sampling.top_p"),
    ("token id", dict(prompt=[1, 99999]), "token_ids: id 99999 outside the vocabulary"),
])
def test_bad_requests_invalid_argument(cluster_1x1, field, kwargs, msg):
    client = Client(cluster_1x1.endpoint)
    kwargs.setdefault("max_tokens", 4)
    with pytest.raises(grpc.RpcError) as e:
        client.generate(Client.request(**kwargs), timeout_s=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert msg in e.value.details()
    client.close()


def test_cancel_mid_stream_frees_pages(cluster_1x1, reference):
    client = Client(cluster_1x1.endpoint)
    call = client.stub.Generate(Client.request(prompt(120, 300), max_tokens=400), timeout=60)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 5:
            break
    call.cancel()
    stats = wait_all_freed(cluster_1x1)
    for name, s in stats.items():
        assert s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total, name
    # The cluster keeps serving correctly afterwards.
    ids = prompt(40, 301)
    assert client.generate(Client.request(ids, max_tokens=6)).token_ids == engine.generate(reference, ids, 6)
    client.close()


def test_flood_beyond_admission_queue():
    with make_cluster(1, 1, conductor_args=("--max-running", "2", "--max-queued", "2")) as c:
        client = Client(c.endpoint)
        results: list = [None] * 16
        ids = [prompt(60 + i, 400 + i) for i in range(16)]

        def one(i):
            try:
                results[i] = client.generate(Client.request(ids[i], max_tokens=20), timeout_s=120)
            except grpc.RpcError as e:
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        done = [(i, r) for i, r in enumerate(results) if not isinstance(r, grpc.RpcError)]
        assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert "admission queue full" in refused[0].details()
        assert len(done) >= 4
        model = engine.load_model("tiny")
        for i, r in done:
            assert r.num_terminal == 1 and r.token_ids == engine.generate(model, ids[i], 20)
        client.close()
        wait_all_freed(c)


def test_small_frames_split_rows_and_stay_exact(reference):
    """With 64 KiB frames (the size of one KDA state) the reused prefix's rows (640 bytes each)
    go out in several frames per layer; the decode worker assembles them exactly."""
    args = ("--max-frame-bytes", str(64 << 10))
    with LocalCluster(ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS + args,
                                    decode_args=DECODE_ARGS)) as c:
        first = prompt(150, 1000)
        second = first[:128] + prompt(20, 1001)
        run_all(c.endpoint, [Client.request(first, max_tokens=2)])
        out = run_all(c.endpoint, [Client.request(second, max_tokens=8)])[0]
    assert out.cached_tokens == 128
    assert out.token_ids == engine.generate(reference, second, 8)


def test_shm_transfer_backend_stays_exact(reference):
    """Both workers on ``--transfer-backend shm``: the prefill worker writes KV straight into the
    decode worker's pages (its cache lives in shareable memory), which verifies it there;
    token-exact with the engine, a reused prefix included."""
    args = ("--transfer-backend", "shm")
    with LocalCluster(ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS + args,
                                    decode_args=DECODE_ARGS + args)) as c:
        check_exact(c.endpoint, reference, [7, 70, 140])
        first = prompt(150, 1100)
        second = first[:128] + prompt(20, 1101)
        run_all(c.endpoint, [Client.request(first, max_tokens=2)])
        out = run_all(c.endpoint, [Client.request(second, max_tokens=8)])[0]
        wait_all_freed(c)
    assert out.cached_tokens == 128
    assert out.token_ids == engine.generate(reference, second, 8)
