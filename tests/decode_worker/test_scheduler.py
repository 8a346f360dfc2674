"""The decode loop and its output stream: every token queued so far leaves in one message (and
the first is never held back for company), tokens stay exact when a slow reader gets them in
batches, cancellation and a short pool end a request with one terminal and free its pages."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import engine
from decode_worker.scheduler import DecodeScheduler, Finished, TokenQueue, take_ready
from decode_worker.server import DecodeService
from engine import SamplingParams, sample
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb

BLOCK = 16


class _KvReady:
    def wait_complete(self, request_id: str, timeout_s: float) -> None:
        return None


class _Call:
    """The part of a gRPC context ``Decode`` uses."""

    def __init__(self) -> None:
        self.callbacks = []

    def add_callback(self, fn) -> bool:
        self.callbacks.append(fn)
        return True

    def is_active(self) -> bool:
        return True

    def abort(self, code, details: str):
        raise AssertionError(f"aborted {code}: {details}")


class _Queued:
    """A scheduler whose request has already produced ``items`` (a reader that fell behind)."""

    def __init__(self, items) -> None:
        self.out = TokenQueue()
        for item in items:
            self.out.put(item)
        self.released = []

    def start_decoding(self, request_id, num_prompt_tokens, first_token, params) -> TokenQueue:
        return self.out

    def release(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


def _decode(service: DecodeService, rid: str, max_tokens: int, prompt_len: int, first: int):
    req = ipb.DecodeRequest(request_id=rid, first_token=first, prompt_tokens=prompt_len)
    req.sampling.max_tokens = max_tokens
    return service.Decode(req, _Call())


@pytest.fixture(scope="module")
def tiny():
    return engine.load_model("tiny")


def test_take_ready_takes_everything_queued_with_the_terminal():
    out = TokenQueue()
    for item in ([1], [2], [3], Finished("length")):
        out.put(item)
    assert take_ready(out, 1.0) == ([1, 2, 3], Finished("length"))


def test_take_ready_returns_a_lone_token_without_waiting_for_more():
    out = TokenQueue()

    def producer():
        time.sleep(0.05)
        out.put([7])
        time.sleep(2.0)
        out.put([8])

    threading.Thread(target=producer, daemon=True).start()
    t0 = time.monotonic()
    assert take_ready(out, 10.0) == ([7], None)
    assert time.monotonic() - t0 < 1.5  # well before the second token
    assert take_ready(out, 10.0) == ([8], None)


def test_take_ready_times_out_empty_and_caps_a_batch():
    out = TokenQueue()
    assert take_ready(out, 0.01) is None
    for t in range(10):
        out.put([t])
    out.put(Finished("stop"))
    assert take_ready(out, 1.0, max_tokens=4) == ([0, 1, 2, 3], None)
    assert take_ready(out, 1.0, max_tokens=4) == ([4, 5, 6, 7], None)
    assert take_ready(out, 1.0, max_tokens=4) == ([8, 9], Finished("stop"))


def test_decode_rpc_sends_every_queued_token_in_one_message():
    sched = _Queued([[11], [12], [13], Finished("length")])
    msgs = list(_decode(DecodeService(sched, _KvReady(), 5.0), "r", 4, 8, 10))
    assert msgs == [ipb.DecodeResponse(token_ids=[11, 12, 13], finish_reason=pb.FINISH_REASON_LENGTH)]


def test_decode_rpc_sends_a_token_alone_while_the_reader_keeps_up():
    sched = _Queued([[11]])
    stream = _decode(DecodeService(sched, _KvReady(), 5.0), "r", 4, 8, 10)
    assert next(stream) == ipb.DecodeResponse(token_ids=[11])
    sched.out.put([12])
    sched.out.put(Finished("stop"))
    assert list(stream) == [ipb.DecodeResponse(token_ids=[12], finish_reason=pb.FINISH_REASON_STOP)]


def _prefilled(sched: DecodeScheduler, model, rid: str, prompt: list[int], max_new: int, params: SamplingParams):
    """Reserves and prefills ``prompt`` into the scheduler's cache, as the KV transfer would."""
    seq = sched.try_reserve(rid, len(prompt) + max_new)
    assert seq is not None
    with torch.inference_mode():
        logits = model.prefill(sched.cache, seq, prompt)
    return sample(logits, [params], [len(prompt)])[0]


def test_slow_reader_gets_batches_and_exact_tokens(tiny):
    prompt = [(i * 37) % 250 + 1 for i in range(40)]
    kwargs = dict(temperature=0.8, top_p=0.9, seed=5)
    want = engine.generate(tiny, prompt, 24, **kwargs)
    sched = DecodeScheduler(tiny, 64, 4, BLOCK)
    sched.start()
    try:
        params = SamplingParams(max_new_tokens=24, **kwargs)
        first = _prefilled(sched, tiny, "slow", prompt, 24, params)
        req = ipb.DecodeRequest(request_id="slow", first_token=first, prompt_tokens=len(prompt),
                                sampling=pb.SamplingParams(max_tokens=24, **kwargs))
        msgs = []
        for msg in DecodeService(sched, _KvReady(), 5.0).Decode(req, _Call()):
            msgs.append(msg)
            time.sleep(0.3)  # a client slower than the decode step
        got = [first] + [t for m in msgs for t in m.token_ids]
        assert got == want
        assert len(msgs) < 23 / 2, [len(m.token_ids) for m in msgs]  # 23 decoded tokens, batched
        assert [m.finish_reason for m in msgs] == [0] * (len(msgs) - 1) + [pb.FINISH_REASON_LENGTH]
        sched.check_integrity()
        assert sched.cache.pool.num_free == 64
    finally:
        sched.stop()


def test_batch_of_requests_stays_exact_and_frees_everything(tiny):
    sched = DecodeScheduler(tiny, 256, 8, BLOCK, max_batch=8)
    sched.start()
    try:
        cases = []
        for i in range(6):
            prompt = [(j * 13 + i * 7) % 250 + 1 for j in range(10 + 9 * i)]
            kwargs = dict(temperature=1.1, seed=i) if i % 2 else {}
            params = SamplingParams(max_new_tokens=5 + i, **kwargs)
            first = _prefilled(sched, tiny, f"r{i}", prompt, params.max_new_tokens, params)
            cases.append((f"r{i}", prompt, params, first, engine.generate(tiny, prompt, 5 + i, **kwargs)))
        outs = [(sched.start_decoding(rid, len(p), first, params), first, want)
                for rid, p, params, first, want in cases]
        for out, first, want in outs:
            got, finished = [first], None
            while finished is None:
                tokens, finished = take_ready(out, 30.0)
                got += tokens
            assert finished == Finished("length")
            assert got == want
        sched.check_integrity()
        assert sched.cache.pool.num_free == 256
    finally:
        sched.stop()


def test_release_of_a_running_request_ends_it_cancelled(tiny):
    sched = DecodeScheduler(tiny, 64, 2, BLOCK)
    sched.start()
    try:
        params = SamplingParams(max_new_tokens=500)
        first = _prefilled(sched, tiny, "c", [5] * 20, 500, params)
        out = sched.start_decoding("c", 20, first, params)
        tokens, finished = take_ready(out, 30.0)
        assert tokens and finished is None
        assert sched.release("c")
        while finished is None:
            _, finished = take_ready(out, 30.0)
        assert finished == Finished("cancelled")
        assert not sched.release("c")
        sched.check_integrity()
        assert sched.cache.pool.num_free == 64
    finally:
        sched.stop()


def test_start_decoding_grows_a_short_reservation_or_fails_it(tiny):
    sched = DecodeScheduler(tiny, 4, 2, BLOCK)
    sched.start()
    try:
        # Reserved for 16 tokens (one page); 16 + 40 need four pages, the pool has them.
        assert sched.try_reserve("grow", 16) is not None
        tokens, finished, out = [], None, sched.start_decoding("grow", 16, 3, SamplingParams(max_new_tokens=40))
        while finished is None:
            more, finished = take_ready(out, 30.0)
            tokens += more
        assert finished == Finished("length") and len(tokens) == 39
        # Now 16 + 100 tokens need 8 pages of a 4-page pool: one terminal, nothing held.
        assert sched.try_reserve("short", 16) is not None
        out = sched.start_decoding("short", 16, 3, SamplingParams(max_new_tokens=100))
        assert take_ready(out, 5.0) == ([], Finished("failed", "out of cache pages"))
        sched.check_integrity()
        assert sched.cache.pool.num_free == 4
    finally:
        sched.stop()


class _Broken:
    """The tiny model whose decode step raises: the loop must fail each request once and go on."""

    def __init__(self, model) -> None:
        self.model = model

    def new_cache(self, num_pages: int, num_slots: int, block_size: int):
        return self.model.new_cache(num_pages, num_slots, block_size)

    def decode_step(self, cache, seqs, token_ids):
        raise RuntimeError("device lost")


def test_a_failing_step_ends_every_request_with_one_terminal(tiny):
    sched = DecodeScheduler(_Broken(tiny), 16, 4, BLOCK)
    sched.start()
    try:
        outs = []
        for i in range(3):
            assert sched.try_reserve(f"f{i}", 40) is not None
            outs.append(sched.start_decoding(f"f{i}", 20, 3, SamplingParams(max_new_tokens=20)))
        for out in outs:
            tokens, finished = take_ready(out, 30.0)
            assert tokens == [] and finished.reason == "failed" and "device lost" in finished.error
            assert take_ready(out, 0.2) is None  # nothing after the terminal
        sched.check_integrity()
        assert sched.cache.pool.num_free == 16
    finally:
        sched.stop()


class _Transfers:
    """The receiver as the scheduler sees it: which reservations have KV arriving, and what it
    was told to forget (with the pool's free pages at that moment)."""

    def __init__(self, sched_pool, receiving: set[str]) -> None:
        self.pool, self.arriving, self.cancelled = sched_pool, receiving, []
        self.lost: set[str] = set()

    def receiving(self, request_id: str) -> bool:
        return request_id in self.arriving

    def failure(self, request_id: str) -> str | None:
        return "aborted by the sender" if request_id in self.lost else None

    def cancel(self, request_id: str) -> None:
        self.cancelled.append((request_id, self.pool.num_free))


def _until(condition, timeout_s: float = 30.0) -> None:
    until = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.02)


def test_an_expired_reservation_is_forgotten_by_the_receiver_before_its_pages_are_freed(tiny):
    sched = DecodeScheduler(tiny, 8, 2, BLOCK, reservation_ttl_s=0.05)
    sched.transfers = transfers = _Transfers(sched.cache.pool, receiving=set())
    sched.start()
    try:
        assert sched.try_reserve("gone", 4 * BLOCK) is not None
        _until(lambda: sched.cache.pool.num_free == 8)
        # The receiver forgot it while its four pages were still held: no late KV lands in them.
        assert transfers.cancelled == [("gone", 4)]
        with pytest.raises(Exception, match="no reservation"):
            sched.start_decoding("gone", 4 * BLOCK, 3, SamplingParams(max_new_tokens=2))
        sched.check_integrity()
    finally:
        sched.stop()


def test_a_reservation_whose_kv_is_arriving_is_renewed_until_it_stops(tiny):
    sched = DecodeScheduler(tiny, 8, 2, BLOCK, reservation_ttl_s=0.05)  # its loop not started: checks by hand
    sched.transfers = transfers = _Transfers(sched.cache.pool, receiving={"slow"})

    def check_after_ttl() -> None:
        time.sleep(0.06)
        with sched._lock:
            sched._expire_reservations()

    assert sched.try_reserve("slow", 2 * BLOCK) is not None
    check_after_ttl()
    check_after_ttl()
    assert transfers.cancelled == [] and sched.cache.pool.num_free == 6
    transfers.arriving.clear()  # its sender stopped without finishing (it failed)
    check_after_ttl()
    _until(lambda: sched.cache.pool.num_free == 8)
    assert transfers.cancelled == [("slow", 6)]


def test_expiry_through_the_real_receiver_forgets_the_destination(tiny):
    from decode_worker.sink import expected_for, sink_for
    from kvstore.transfer import Receiver, TransferConfig

    receiver = Receiver(TransferConfig())
    sched = DecodeScheduler(tiny, 8, 2, BLOCK, reservation_ttl_s=0.05, transfers=receiver)
    sched.start()
    try:
        seq = sched.try_reserve("late", 2 * BLOCK)
        receiver.expect("late", sink_for(sched.cache, seq), expected_for(sched.cache, 2 * BLOCK), 600.0)
        assert receiver.num_pending == 1 and not receiver.receiving("late")
        _until(lambda: sched.cache.pool.num_free == 8)
        assert receiver.num_pending == 0  # a prefill pushing its KV now is refused, not written
    finally:
        sched.stop()
        receiver.close()


def test_a_reservation_whose_transfer_failed_is_freed_long_before_its_ttl(tiny):
    sched = DecodeScheduler(tiny, 8, 2, BLOCK, reservation_ttl_s=600.0)  # its loop not started: checks by hand
    sched.transfers = transfers = _Transfers(sched.cache.pool, receiving={"aborted"})
    assert sched.try_reserve("aborted", 2 * BLOCK) is not None
    assert sched.try_reserve("waiting", 2 * BLOCK) is not None
    with sched._lock:
        sched._expire_reservations()
    assert transfers.cancelled == [] and sched.cache.pool.num_free == 4
    transfers.arriving.clear()
    transfers.lost.add("aborted")  # e.g. its prefill worker's ABORT: no Decode call can use it
    with sched._lock:
        sched._expire_reservations()
    _until(lambda: sched.cache.pool.num_free == 6)
    assert transfers.cancelled == [("aborted", 4)]  # forgotten by the receiver before its pages went
    with pytest.raises(Exception, match="no reservation"):
        sched.start_decoding("aborted", 2 * BLOCK, 3, SamplingParams(max_new_tokens=2))
    assert set(sched.load().request_ids) == {"waiting"}  # the other one keeps its TTL


def test_a_senders_abort_through_the_real_receiver_frees_the_reservation(tiny):
    """What a prefill whose Conductor left does (``prefill_worker.runner``): it ABORTs the
    placement, before or after sending any of its KV; the decode worker frees the pages at its
    next check instead of holding them for the reservation's TTL."""
    from decode_worker.sink import expected_for, sink_for
    from kvstore.transfer import Receiver, TransferConfig
    from kvstore.transfer.sender import connect

    receiver = Receiver(TransferConfig())
    sched = DecodeScheduler(tiny, 8, 2, BLOCK, reservation_ttl_s=600.0, transfers=receiver)
    sched.start()
    sender = None
    try:
        seq = sched.try_reserve("orphan", 2 * BLOCK)
        receiver.expect("orphan", sink_for(sched.cache, seq), expected_for(sched.cache, 2 * BLOCK), 600.0)
        assert sched.cache.pool.num_free == 6
        sender = connect(receiver.address, TransferConfig())
        sender.abort("orphan", "cancelled: its Conductor left", wait_s=5.0)
        _until(lambda: sched.cache.pool.num_free == 8)
        assert receiver.num_pending == 0 and sched.load().request_ids == ()
        sched.check_integrity()
    finally:
        if sender is not None:
            sender.close()
        sched.stop()
        receiver.close()


def test_a_renewed_reservation_outlives_its_ttl_and_unknown_ids_are_named(tiny, monkeypatch):
    import decode_worker.scheduler as scheduler_module

    now = [1000.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: now[0])
    sched = DecodeScheduler(tiny, 8, 2, BLOCK, reservation_ttl_s=10.0)  # its loop not started: checks by hand
    assert sched.try_reserve("held", 2 * BLOCK) is not None
    assert sched.try_reserve("dropped", 2 * BLOCK) is not None
    for _ in range(3):  # three TTLs, renewed every 6 s: its Conductor is alive
        now[0] += 6.0
        assert sched.renew(["held", "gone", "never"]) == ["gone", "never"]
        now[0] += 6.0
        with sched._lock:
            sched._expire_reservations()
    assert set(sched.load().request_ids) == {"held"}  # the one not renewed expired after 10 s
    sched.start_decoding("held", 2 * BLOCK, 3, SamplingParams(max_new_tokens=2))
    assert sched.renew(["held"]) == []  # decoding: not unknown
